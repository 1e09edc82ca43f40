"""Where the object tier is and its credentials, read as the AWS tools read them (kvpool/objectstore/settings.py)."""

import pytest

from kvpool.objectstore.settings import parse_url, settings_for


@pytest.mark.parametrize("url, expected", [
    ("s3://kv-cache", ("kv-cache", "", None)),
    ("s3://kv-cache/", ("kv-cache", "", None)),
    ("s3://kv.cache-1/team/llama/", ("kv.cache-1", "team/llama/", None)),
    ("s3://kvc/a", ("kvc", "a/", None)),
    ("s3://kvc/a?encryption=aes-gcm", ("kvc", "a/", "aes-gcm")),
    ("s3://kvc?encryption=aes-gcm", ("kvc", "", "aes-gcm")),
])
def test_urls(url, expected):
    assert parse_url(url) == expected


@pytest.mark.parametrize("url", ["kv-cache/x", "s3:/kv", "s3://", "s3://KV", "s3://ab", "s3://-kv", "s3://kv_x",
                                 "s3://kvc/a//b", "s3://kvc/../b", "s3://kvc/a?x=1", "gs://kvc",
                                 "s3://kvc/a?encryption=aes", "s3://kvc/a?encryption=aes-gcm&x=1", "s3://kvc/a#f",
                                 "s3://kvc/a?encryption", "s3://kvc/a?&&"])
def test_bad_urls_name_the_form(url):
    with pytest.raises(ValueError, match="s3://BUCKET|bucket name|prefix|encryption=aes-gcm"):
        parse_url(url)


def test_the_url_of_settings_keeps_the_encryption_option():
    settings = settings_for("s3://kvc/a?encryption=aes-gcm", {"HOME": "/nonexistent"})
    assert (settings.encryption, settings.url) == ("aes-gcm", "s3://kvc/a/?encryption=aes-gcm")
    assert settings_for(settings.url, {"HOME": "/nonexistent"}) == settings
    assert settings_for("s3://kvc/a", {"HOME": "/nonexistent"}).url == "s3://kvc/a/"


def test_environment_first(tmp_path):
    env = {"HOME": str(tmp_path), "AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_REGION": "eu-west-1",
           "AWS_DEFAULT_REGION": "us-west-2", "AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK",
           "AWS_SESSION_TOKEN": "TOK"}
    s = settings_for("s3://kvc/p", env)
    assert (s.bucket, s.prefix, s.endpoint, s.region, s.access_key_id, s.secret_access_key, s.session_token) == \
        ("kvc", "p/", "http://127.0.0.1:9000", "eu-west-1", "AK", "SK", "TOK")
    assert s.store_config() == {"region": "eu-west-1", "endpoint": "http://127.0.0.1:9000", "access_key_id": "AK",
                                "secret_access_key": "SK", "session_token": "TOK"}
    assert "SK" not in repr(s) and "TOK" not in repr(s)
    assert settings_for("s3://kvc", {"HOME": str(tmp_path), "AWS_ENDPOINT_URL_S3": "https://s3.example",
                                     "AWS_ENDPOINT_URL": "http://other"}).endpoint == "https://s3.example"


def test_shared_files_and_profiles(tmp_path):
    aws = tmp_path / ".aws"
    aws.mkdir()
    (aws / "credentials").write_text("[default]\naws_access_key_id = DEF\naws_secret_access_key = DEFS\n"
                                     "[team]\naws_access_key_id = TEAM\naws_secret_access_key = TEAMS\n")
    (aws / "config").write_text("[default]\nregion = ap-south-1\n[profile team]\nregion = sa-east-1\n"
                                "endpoint_url = http://127.0.0.1:8333\n")
    s = settings_for("s3://kvc", {"HOME": str(tmp_path)})
    assert (s.access_key_id, s.secret_access_key, s.region, s.endpoint) == ("DEF", "DEFS", "ap-south-1", None)
    s = settings_for("s3://kvc", {"HOME": str(tmp_path), "AWS_PROFILE": "team"})
    assert (s.access_key_id, s.region, s.endpoint) == ("TEAM", "sa-east-1", "http://127.0.0.1:8333")
    elsewhere = tmp_path / "creds"
    elsewhere.write_text("[default]\naws_access_key_id = ELSE\naws_secret_access_key = ELSES\n")
    assert settings_for("s3://kvc", {"HOME": str(tmp_path),
                                     "AWS_SHARED_CREDENTIALS_FILE": str(elsewhere)}).access_key_id == "ELSE"
    none = settings_for("s3://kvc", {"HOME": str(tmp_path / "nobody")})
    assert (none.access_key_id, none.region) == (None, "us-east-1") and "access_key_id" not in none.store_config()


def test_bad_settings_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="AWS_SECRET_ACCESS_KEY"):
        settings_for("s3://kvc", {"HOME": str(tmp_path), "AWS_ACCESS_KEY_ID": "AK"})
    with pytest.raises(ValueError, match="http"):
        settings_for("s3://kvc", {"HOME": str(tmp_path), "AWS_ENDPOINT_URL": "127.0.0.1:9000"})
    bad = tmp_path / "bad"
    bad.write_text("not an ini file\n")
    with pytest.raises(ValueError, match="not an AWS config file"):
        settings_for("s3://kvc", {"HOME": str(tmp_path), "AWS_CONFIG_FILE": str(bad)})
