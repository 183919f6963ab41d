"""The dense cache's attention (``tqkern_torch.dense.dense_attention``) equals the prefill oracle.

A dense cache ``[batch, tokens, Hkv, slot_bytes]`` is a paged cache with an identity block table,
so ``dense_attention``'s causal form is a varlen prefill: row b's last ``min(Lq, lengths[b])``
queries sit at positions ``max(lengths[b] − Lq, 0) ..`` and see the tokens up to their own; its
first ``Lq − lengths[b]`` queries (positions below 0) see nothing: zeros. Drawn: every preset,
head_dim 32/64 (and 128 on a GPU), a GQA group, 1–3 rows of 16–48 tokens (written by the compress
oracle; tokens past a row's length hold random bytes), lengths in ``[0, tokens]``, ``Lq`` 1–12
(so the decode kernel, the short-row path, the prefill kernel and, for a row shorter than ``Lq``,
the decompress path all run), ``lengths_cpu`` given or not, and up to two non-finite query
elements (their rows must come out NaN). Tolerance: the prefill property test's ``_compare``
(``(4e-3 + 2·δ)·max|V̂|`` of each row, δ the logit rounding bound).
"""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tqkern
import tqkern.testing as T
from tqkern import reference as ref
from tqkern.layouts import PRESETS
from tqkern_torch.dense import dense_attention, dense_layout
from tqkern_torch.testing import to_torch_kv

# the prefill property tests' comparison, device and marks (kernels needed; NaN queries on purpose)
from property_tests import test_prefill_triton as _prefill

pytestmark = _prefill.pytestmark
DEV, ON_GPU, _compare = _prefill.DEV, _prefill.ON_GPU, _prefill._compare


@st.composite
def dense_cases(draw):
    """(format, params, Hkv, GQA group, tokens per row, Lq, lengths)."""
    fmt = tqkern.KVFormat.preset(draw(st.sampled_from(sorted(PRESETS)), label="preset"),
                                 draw(st.sampled_from([32, 64] + ([128] if ON_GPU else [])), label="head_dim"))
    h = draw(st.integers(1, 2), label="num_kv_heads")
    params = draw(T.tq_params(fmt, h), label="params")
    group = draw(st.integers(1, 3), label="gqa_group")
    t = draw(st.sampled_from([16, 24, 48]), label="tokens")
    lq = draw(st.integers(1, 12), label="lq")
    rows = draw(st.integers(1, 3), label="rows")
    lengths = draw(st.lists(st.one_of(st.integers(0, t), st.just(t)), min_size=rows, max_size=rows), label="lengths")
    return fmt, params, h, group, t, lq, np.asarray(lengths, np.int32)


def _rows(fmt, params, h, t, lengths, data) -> np.ndarray:
    """The dense cache: each row's first ``lengths[b]`` tokens compressed by the oracle, random
    bytes after them."""
    b = len(lengths)
    kv = np.random.default_rng(data.draw(st.integers(0, 2**16), label="bytes_seed")).integers(
        0, 256, size=(b, t, h, fmt.slot_bytes), dtype=np.uint8)
    for r, n in enumerate(lengths):
        if n:
            k, v = data.draw(T.kv_arrays(int(n), h, fmt.head_dim, dtype=np.float16), label=f"kv{r}")
            kv[r, :n] = ref.compress(k, v, params)
    return kv


@settings(max_examples=T.scale(12, 60))
@given(dense_cases(), st.data())
def test_dense_attention_matches_the_prefill_oracle(case, data):
    fmt, params, h, group, t, lq, lengths = case
    b, d, hq = len(lengths), fmt.head_dim, h * group
    kv = _rows(fmt, params, h, t, lengths, data)
    qdtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16] if ON_GPU else [torch.float16]), label="qdt")
    q_np = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="q_seed")).standard_normal(
        (b, hq, lq, d)).astype(np.float32) * np.float32(data.draw(st.sampled_from([0.05, 0.3, 1.0]), label="sigma"))
    for r, hh, i, x in data.draw(st.lists(st.tuples(st.integers(0, b - 1), st.integers(0, hq - 1),
                                                    st.integers(0, lq - 1), st.sampled_from([np.nan, np.inf])),
                                          max_size=2), label="non_finite_q"):
        q_np[r, hh, i, 0] = x
    q, q64 = to_torch_kv(q_np, qdtype, DEV)
    lens = torch.from_numpy(lengths).to(DEV)
    host = torch.from_numpy(lengths) if data.draw(st.booleans(), label="lengths_cpu") else None
    got = dense_attention(q, torch.from_numpy(kv).to(DEV), lens, fmt, params, lengths_cpu=host).float().cpu().numpy()
    assert got.shape == (b, hq, lq, d)

    # the oracle: row r's last min(Lq, lengths[r]) queries as sequence r of a varlen prefill
    layout = dense_layout(fmt, h, t)
    per = t // layout.block_size
    q_lens = np.minimum(lq, lengths)
    batch = T.VarlenBatch(np.arange(b * per, dtype=np.int32).reshape(b, per), lengths, b * per, layout.block_size,
                          q_lens)
    tokens = lambda x: np.concatenate([x[r, :, lq - q_lens[r]:].transpose(1, 0, 2) for r in range(b)])  # noqa: E731
    cache = kv.reshape(layout.cache_shape(b * per))
    expect = ref.prefill(tokens(q64), cache, batch.block_table, lengths, batch.query_start_loc, layout, params)
    # (the decompress path rounds K and V to q's dtype: the workspace's roundings on a GPU)
    _compare(tokens(got), expect, layout, params, batch, cache, tokens(q64), group,
             rnd=_prefill.rounding(layout, q, workspace=ON_GPU))
    for r in range(b):  # queries before position 0: zeros, NaN for a non-finite query row
        unseen, q_unseen = got[r, :, :lq - q_lens[r]], q64[r, :, :lq - q_lens[r]]
        bad = ~np.isfinite(q_unseen).all(-1)
        assert np.all(np.isnan(unseen[bad])) and np.all(unseen[~bad] == 0), f"row {r}: queries that see nothing"
