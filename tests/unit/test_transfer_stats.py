"""The transfer counts an engine connector reports (the vLLM connector hands them to vLLM as KVConnectorStats):
summed across steps and workers, summarized once per logging interval."""

from kvpool.connectors.transfer_stats import COUNTS, add_counts, is_empty, summarize


def test_counts_from_two_workers_add_up_name_by_name():
    rank0 = {"loads": 1, "blocks_loaded": 4, "bytes_loaded": 4096, "blocks_failed": 1, "load_seconds": 0.25}
    rank1 = {"loads": 1, "blocks_loaded": 5, "bytes_loaded": 5120, "load_seconds": 0.5, "blocks_saved": 2}
    total = add_counts(dict(rank0), rank1)
    assert total == {"loads": 2, "blocks_loaded": 9, "bytes_loaded": 9216, "blocks_failed": 1, "load_seconds": 0.75,
                     "blocks_saved": 2}
    assert rank1 == {"loads": 1, "blocks_loaded": 5, "bytes_loaded": 5120, "load_seconds": 0.5, "blocks_saved": 2}


def test_an_interval_with_nothing_moved_is_empty():
    assert is_empty({}) and is_empty({"loads": 0, "load_seconds": 0.0})
    assert not is_empty({"blocks_save_failed": 3})  # a failure is something to report
    assert not is_empty({"saves": 1})  # a save whose blocks kvpool already held still took a transfer


def test_the_summary_names_every_count_and_the_average_load_time():
    summary = summarize({"loads": 4, "blocks_loaded": 10, "load_seconds": 0.0123456, "save_seconds": 1.23449})
    assert set(summary) == set(COUNTS) | {"avg_load_ms"}
    assert summary["blocks_loaded"] == 10 and summary["bytes_saved"] == 0  # absent counts are 0
    assert summary["load_seconds"] == 0.012 and summary["save_seconds"] == 1.234
    assert summary["avg_load_ms"] == 3.086  # 12.3456 ms over 4 loads
    assert summarize({})["avg_load_ms"] == 0.0  # no load: no division by zero
