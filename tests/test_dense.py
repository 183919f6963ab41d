"""tqkern_torch.dense: a dense [batch, tokens, H, slot_bytes] cache through the paged kernels, against
the NumPy oracles (CPU: the interpreter or the NumPy fallback; GPU when present)."""

import numpy as np
import pytest
import torch

import tqkern
import tqkern_torch as tqt
from tqkern import reference as ref
from tqkern_torch.dense import dense_attention, dense_decode, dense_layout, dense_store
from tqkern_torch.testing import device_under_test

DEV = device_under_test()


def _case(preset="turboquant_4bit_nc", b=3, t=48, h=2, d=64, seed=0):
    fmt = tqkern.KVFormat.preset(preset, d)
    params = tqkern.TQParams.default(fmt, seed=seed)
    g = torch.Generator().manual_seed(seed)
    kv = torch.zeros(b, t, h, fmt.slot_bytes, dtype=torch.uint8, device=DEV)
    key = torch.randn(b, t, h, d, generator=g).half().to(DEV)
    value = torch.randn(b, t, h, d, generator=g).half().to(DEV)
    return fmt, params, kv, key, value


@pytest.mark.parametrize("t,bs", [(48, 16), (40, 8), (7, 1), (2048, 1024), (96, 32)])
def test_dense_layout_block_size(t, bs):
    assert dense_layout(tqkern.KVFormat.preset("tq4", 64), 2, t).block_size == bs


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tq4", "fp16"])
def test_store_writes_the_oracle_bytes_at_row_positions(preset):
    """Tokens written at ``start[b] ..`` of row b hold the compress oracle's bytes (up to rounding
    ties); every other slot stays zero; positions past the row are skipped and flagged."""
    fmt, params, kv, key, value = _case(preset)
    start = torch.tensor([0, 10, 44], dtype=torch.int32, device=DEV)  # row 2: 4 of its 8 tokens fit
    n = 8
    tqt.read_errors(DEV)  # (clears nothing: read the word before)
    dense_store(kv, key[:, :n], value[:, :n], start, fmt, params)
    want = np.zeros(kv.shape, np.uint8)
    unsure = np.zeros(kv.shape, bool)
    for r in range(3):
        k_np, v_np = key[r, :n].cpu().numpy(), value[r, :n].cpu().numpy()
        slots, unc = ref.compress(k_np, v_np, params, return_uncertain=True)
        s0 = int(start[r])
        m = min(n, kv.shape[1] - s0)
        want[r, s0: s0 + m] = slots[:m]
        unsure[r, s0: s0 + m] = unc[:m]
    got = kv.cpu().numpy()
    assert np.array_equal(got[~unsure], want[~unsure])
    assert tqt.read_errors(DEV) & tqkern.errors.ErrorFlag.SLOT_OUT_OF_RANGE


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "tq4"])
def test_decode_equals_the_paged_oracle(preset):
    fmt, params, kv, key, value = _case(preset)
    dense_store(kv, key, value, torch.zeros(3, dtype=torch.int32, device=DEV), fmt, params)
    lengths = torch.tensor([48, 17, 0], dtype=torch.int32, device=DEV)
    q = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(1)).half().to(DEV)
    got = dense_decode(q, kv, lengths, fmt, params).float().cpu().numpy()
    layout = dense_layout(fmt, 2, 48)
    table = np.arange(9, dtype=np.int32).reshape(3, 3)
    want = ref.paged_decode(q.float().cpu().numpy(), kv.cpu().numpy().reshape(layout.cache_shape(9)), table,
                            lengths.cpu().numpy(), layout, params)
    assert np.abs(got - want).max() < 4e-3 * (np.abs(want).max() + 1)
    assert not got[2].any()  # an empty row: zeros


def _prefill_oracle(q, kv, lengths, fmt, params):
    """The prefill oracle of ``q [b, Hq, Lq, D]`` over the dense cache's rows (identity table)."""
    b, hq, lq, d = q.shape
    t = kv.shape[1]
    layout = dense_layout(fmt, kv.shape[2], t)
    per = t // layout.block_size
    table = np.arange(b * per, dtype=np.int32).reshape(b, per)
    qv = q.float().cpu().numpy().transpose(0, 2, 1, 3).reshape(b * lq, hq, d)
    want = ref.prefill(qv, kv.cpu().numpy().reshape(layout.cache_shape(b * per)), table, lengths.cpu().numpy(),
                       np.arange(0, b * lq + 1, lq, dtype=np.int32), layout, params)
    return want.reshape(b, lq, hq, d).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("lq", [4, 12])
def test_attention_causal_equals_the_prefill_oracle_and_the_mask_path(lq, monkeypatch):
    """Lq queries at the last positions of each row, bottom-right causal: the prefill oracle over
    the same bytes, through ``prefill`` (every length ≥ Lq; short rows at Lq = 4, the prefill
    kernel at 12), with the host lengths given or read; the same causal pattern given as a mask
    (decompress + SDPA) agrees; a row whose queries see nothing (length 0) gives zeros."""
    import tqkern_torch.dense as dense

    calls = []
    monkeypatch.setattr(dense, "prefill", lambda *a, **k: calls.append(k["max_query_len"]) or tqt.prefill(*a, **k))
    fmt, params, kv, key, value = _case()
    dense_store(kv, key, value, torch.zeros(3, dtype=torch.int32, device=DEV), fmt, params)
    lengths = torch.tensor([48, 13, 30], dtype=torch.int32, device=DEV)
    q = torch.randn(3, 4, lq, 64, generator=torch.Generator().manual_seed(2)).half().to(DEV)
    want = _prefill_oracle(q, kv, lengths, fmt, params)
    tol = 4e-3 * (np.abs(want).max() + 1)
    got = dense_attention(q, kv, lengths, fmt, params)
    assert got.shape == q.shape and got.is_contiguous() and calls == [lq]
    assert np.abs(got.float().cpu().numpy() - want).max() < tol
    got_host = dense_attention(q, kv, lengths, fmt, params, lengths_cpu=lengths.cpu().long())
    assert calls == [lq, lq] and torch.equal(got_host, got)
    pos = torch.arange(48, device=DEV)
    qpos = lengths.long()[:, None] - lq + torch.arange(lq, device=DEV)[None, :]
    mask = (pos[None, None, :] <= qpos[:, :, None])[:, None]
    got_mask = dense_attention(q, kv, lengths, fmt, params, mask=mask).float().cpu().numpy()
    assert calls == [lq, lq] and np.abs(got_mask - want).max() < tol
    none = dense_attention(q, kv, torch.zeros(3, dtype=torch.int32, device=DEV), fmt, params)
    assert not none.any() and calls == [lq, lq]


def test_attention_rows_shorter_than_the_queries_and_capture_take_the_decompress_path(monkeypatch):
    """A row of fewer tokens than Lq (its first queries see nothing: zeros), and any causal call
    while a graph is captured or traced (no host read of the lengths), run decompress + SDPA; a
    call whose rows are long enough agrees with it."""
    import tqkern_torch.dense as dense

    calls = []
    monkeypatch.setattr(dense, "prefill", lambda *a, **k: calls.append(1) or tqt.prefill(*a, **k))
    fmt, params, kv, key, value = _case()
    dense_store(kv, key, value, torch.zeros(3, dtype=torch.int32, device=DEV), fmt, params)
    q = torch.randn(3, 4, 4, 64, generator=torch.Generator().manual_seed(4)).half().to(DEV)
    short = torch.tensor([48, 2, 30], dtype=torch.int32, device=DEV)
    got = dense_attention(q, kv, short, fmt, params)
    assert not calls and not got[1, :, :2].any() and got[1, :, 2:].abs().sum() > 0
    lengths = torch.tensor([48, 13, 30], dtype=torch.int32, device=DEV)
    by_prefill = dense_attention(q, kv, lengths, fmt, params)
    monkeypatch.setattr(dense, "_tracing_or_capturing", lambda dev: True)
    captured = dense_attention(q, kv, lengths, fmt, params)
    assert calls == [1] and (captured.float() - by_prefill.float()).abs().max() < 4e-3 * (
        by_prefill.float().abs().max() + 1)


def test_attention_one_query_runs_decode_and_nan_rows_stay_nan():
    fmt, params, kv, key, value = _case()
    dense_store(kv, key, value, torch.zeros(3, dtype=torch.int32, device=DEV), fmt, params)
    lengths = torch.tensor([48, 9, 0], dtype=torch.int32, device=DEV)
    q = torch.randn(3, 4, 1, 64, generator=torch.Generator().manual_seed(3)).half().to(DEV)
    q[1, 2, 0, 5] = float("nan")
    got = dense_attention(q, kv, lengths, fmt, params)
    assert torch.equal(got[:, :, 0].nan_to_num(7), dense_decode(q[:, :, 0], kv, lengths, fmt, params).nan_to_num(7))
    assert got[1, 2].isnan().all() and not got[1, 1].isnan().any()
    q2 = q.repeat(1, 1, 2, 1)
    out2 = dense_attention(q2, kv, lengths, fmt, params)
    assert out2[1, 2].isnan().all() and not out2[0].isnan().any() and not out2[2].any()  # (row 2: no tokens)


def test_bad_input():
    fmt, params, kv, key, value = _case()
    lengths = torch.zeros(3, dtype=torch.int32, device=DEV)
    q = torch.zeros(3, 4, 64, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match=r"kv must have shape \[batch, tokens >= 1, num_kv_heads, 70\]"):
        dense_decode(q, kv[..., :10].contiguous(), lengths, fmt, params)
    with pytest.raises(TypeError, match="kv must be uint8, got float32"):
        dense_decode(q, kv.float(), lengths, fmt, params)
    with pytest.raises(ValueError, match=r"lengths must have shape \[3\]"):
        dense_decode(q, kv, lengths[:2], fmt, params)
    with pytest.raises(ValueError, match=r"key must have shape \[3, n, 2, 64\]"):
        dense_store(kv, key[:2], value[:2], lengths, fmt, params)
    with pytest.raises(ValueError, match=r"q must have shape \[3, Hq, Lq, 64\]"):
        dense_attention(q, kv, lengths, fmt, params)
    with pytest.raises(ValueError, match=r"mask must have shape \[3, 1 or 4, 2, 48\]"):
        dense_attention(q[:, :, None].repeat(1, 1, 2, 1), kv, lengths, fmt, params,
                        mask=torch.ones(3, 1, 2, 47, dtype=torch.bool, device=DEV))
    with pytest.raises(TypeError, match="fmt must be a tqkern.KVFormat, got str"):
        dense_layout("tq4", 2, 16)
    for fn, args in ((dense_store, (kv, key, value, lengths)), (dense_decode, (q, kv, lengths)),
                     (dense_attention, (q[:, :, None], kv, lengths))):
        with pytest.raises(TypeError, match="fmt must be a tqkern.KVFormat, got str"):
            fn(*args, "tq4", params)
    with pytest.raises(ValueError, match=r"lengths_cpu must have shape \[3\]"):
        dense_attention(q[:, :, None].repeat(1, 1, 2, 1), kv, lengths, fmt, params, lengths_cpu=torch.zeros(2).int())
    with pytest.raises(TypeError, match="lengths_cpu must be int32 or int64, got float32"):
        dense_attention(q[:, :, None].repeat(1, 1, 2, 1), kv, lengths, fmt, params, lengths_cpu=torch.zeros(3))
    with pytest.raises(TypeError, match="kv must be a torch.Tensor, got NoneType"):
        dense_attention(q[:, :, None], None, lengths, fmt, params)
    q4 = q[:, :, None].repeat(1, 1, 2, 1)
    for bad_q in (q[:, :, None], q4):  # the decode path (Lq = 1) and the SDPA path
        with pytest.raises(ValueError, match="scale must be finite, got nan"):
            dense_attention(bad_q, kv, lengths, fmt, params, scale=float("nan"))
        with pytest.raises(TypeError, match="scale must be a real number or None, got str"):
            dense_attention(bad_q, kv, lengths, fmt, params, scale="0.1")


def test_attention_flags_lengths_out_of_range_on_both_paths():
    """A length outside [0, tokens] is clamped and sets SEQ_LEN_OUT_OF_RANGE in the error word,
    one query (the decode kernel) or several (decompress + SDPA) alike; in-range lengths set nothing."""
    from tqkern.errors import ErrorFlag

    fmt, params, kv, _, _ = _case()
    q = torch.zeros(3, 4, 2, 64, dtype=torch.float16, device=DEV)
    tqt.read_errors(DEV)
    dense_attention(q, kv, torch.tensor([5, 48, 0], dtype=torch.int32, device=DEV), fmt, params)
    assert tqt.read_errors(DEV) == ErrorFlag(0)
    for lq in (1, 2):
        for lens in ([5, 49, 0], [5, -1, 0]):
            dense_attention(q[:, :, :lq], kv, torch.tensor(lens, dtype=torch.int32, device=DEV), fmt, params)
            assert tqt.read_errors(DEV) & ErrorFlag.SEQ_LEN_OUT_OF_RANGE, (lq, lens)
