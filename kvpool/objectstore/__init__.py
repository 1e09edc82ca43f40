"""The object tier's store: an S3-compatible bucket (settings.py: where and with which credentials; bucket.py:
the calls, each bounded)."""
