"""engine/runner/memory_plan_cache.py: a start finds the figures an earlier start with the same key
measured, and nothing else: another key, a damaged entry or one with figures missing is measured again."""
import json

from engine.runner.memory_plan_cache import MemoryPlanCache

KEY = {"format": 1, "gpu": "NVIDIA H200", "options": {"max_num_seqs": "64", "dtype": "torch.bfloat16"},
       "hf_config": {"hidden_size": 576, "rope_scaling": None}, "rank": 0, "code": "abc"}
NEEDS = {"activations": 123 << 20, "graph_pool": 45 << 20, "loaded": 67 << 20}


def test_an_entry_is_found_by_the_same_key_only(tmp_path):
    MemoryPlanCache(KEY, tmp_path).write(NEEDS)
    assert MemoryPlanCache(json.loads(json.dumps(KEY)), tmp_path).read() == NEEDS
    for change in ({"rank": 1}, {"code": "abd"}, {"options": {**KEY["options"], "max_num_seqs": "256"}}):
        assert MemoryPlanCache({**KEY, **change}, tmp_path).read() is None


def test_a_damaged_or_incomplete_entry_is_not_used(tmp_path):
    cache = MemoryPlanCache(KEY, tmp_path)
    cache.write(NEEDS)
    entry = json.loads(cache.path.read_text())
    for bad in ("{not json", json.dumps({**entry, "needs": {"activations": 1, "graph_pool": 2}}),
                json.dumps({**entry, "needs": {**NEEDS, "loaded": -1}}), json.dumps({**entry, "key": {**KEY, "rank": 1}})):
        cache.path.write_text(bad)
        assert cache.read() is None
    cache.write(NEEDS)  # measured again, and written over it
    assert cache.read() == NEEDS


def test_an_unwritable_cache_is_no_error(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    cache = MemoryPlanCache(KEY, blocked)  # its directory would have to be inside a file
    cache.write(NEEDS)
    assert cache.read() is None
