"""probe: snapshot -> rows, against constructions with known answers."""

import math

import numpy as np
import pytest
import torch

from qkgeom import config as C
from qkgeom.probing import alpha as AL
from qkgeom.probing import geometry as G
from qkgeom.probing import weights as W
from qkgeom.probing.probe import GeometryAccumulator, QKSnapshot, weight_geometry


def rows_to_dict(rows):
    return {(r["layer"], r["head"], r["metric"]): r["value"] for r in rows}


def iso_heads(B, H, T, E, scale=1.0):
    return torch.randn(B, H, T, E, dtype=torch.float64) * scale


def test_known_pr_and_contrast_per_head_and_layer():
    torch.manual_seed(0)
    B, H, T, E = 4, 2, 64, 4
    q = iso_heads(B, H, T, E)  # isotropic: PR ~ E per head, ~H*E per layer
    k = torch.randn(B, H, T, 1, dtype=torch.float64) * torch.ones(E, dtype=torch.float64)  # rank one per head
    uniform = torch.tril(torch.ones(T, T))
    uniform = (uniform / uniform.sum(-1, keepdim=True)).expand(B, H, T, T)
    acc = GeometryAccumulator()
    acc.update(QKSnapshot(q=[q], k=[k], pattern=[uniform]))
    r = rows_to_dict(acc.rows())
    assert r[(0, 0, "key_participation_ratio")] == pytest.approx(1.0)
    assert r[(0, -1, "key_participation_ratio")] == pytest.approx(2.0, rel=0.1)  # two independent rank-one heads
    assert r[(0, 0, "query_participation_ratio")] == pytest.approx(E, rel=0.1)
    assert r[(0, 1, "participation_ratio_contrast")] == pytest.approx(
        r[(0, 1, "query_participation_ratio")] - r[(0, 1, "key_participation_ratio")]
    )
    # uniform causal attention: entropy log k per row; normalised 1
    expected = sum(math.log(t) for t in range(2, T + 1)) / (T - 1)
    assert r[(0, 0, "attention_entropy")] == pytest.approx(expected)
    assert r[(0, 0, "attention_entropy_normalised")] == pytest.approx(1.0)
    assert r[(0, 0, "attention_entropy_normalised_median")] == pytest.approx(1.0, abs=1e-3)


def test_streaming_two_batches_equals_one():
    torch.manual_seed(1)
    q, k = iso_heads(6, 2, 8, 3), iso_heads(6, 2, 8, 3)
    pat = torch.softmax(torch.randn(6, 2, 8, 8).masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), -1e9), -1)
    one, two = GeometryAccumulator(), GeometryAccumulator()
    one.update(QKSnapshot([q], [k], [pat]))
    two.update(QKSnapshot([q[:2]], [k[:2]], [pat[:2]]))
    two.update(QKSnapshot([q[2:]], [k[2:]], [pat[2:]]))
    a, b = rows_to_dict(one.rows()), rows_to_dict(two.rows())
    assert a.keys() == b.keys()
    for key in a:
        if "median" in key[2]:
            continue
        assert a[key] == pytest.approx(b[key], rel=1e-9), key


def test_grouped_query_pairs_query_heads_with_their_key_head():
    torch.manual_seed(2)
    q = iso_heads(2, 4, 32, 4)
    k = torch.cat([iso_heads(2, 1, 32, 4), torch.randn(2, 1, 32, 1, dtype=torch.float64).expand(2, 1, 32, 4)], 1)
    acc = GeometryAccumulator()
    acc.update(QKSnapshot([q], [k], [None]))
    r = rows_to_dict(acc.rows())
    assert r[(0, 1, "key_participation_ratio")] == pytest.approx(1.0)
    for h in range(4):  # heads 0,1 read key head 0; heads 2,3 read key head 1
        kv = h // 2
        assert r[(0, h, "participation_ratio_contrast")] == pytest.approx(
            r[(0, h, "query_participation_ratio")] - r[(0, kv, "key_participation_ratio")]
        )


def test_padding_mask_excludes_tokens():
    torch.manual_seed(3)
    q, k = iso_heads(2, 1, 10, 3), iso_heads(2, 1, 10, 3)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 6:] = False
    garbage_q = q.clone()
    garbage_q[1, :, 6:] = 1e6  # must not matter
    a, b = GeometryAccumulator(), GeometryAccumulator()
    a.update(QKSnapshot([garbage_q], [k], [None], token_mask=mask))
    b.update(QKSnapshot([q[:1]], [k[:1]], [None]))
    b.update(QKSnapshot([q[1:, :, :6]], [k[1:, :, :6]], [None]))
    ra, rb = rows_to_dict(a.rows()), rows_to_dict(b.rows())
    assert ra[(0, 0, "query_participation_ratio")] == pytest.approx(rb[(0, 0, "query_participation_ratio")])


def test_weight_geometry_orthogonal_heads():
    basis, _ = torch.linalg.qr(torch.randn(16, 8, dtype=torch.float64))
    wq = basis[:, :4].unsqueeze(0)  # (1, 16, 4), singular values all 1 -> PR 4
    wk = 2 * basis[:, :4].unsqueeze(0)
    rows, spectra = weight_geometry([wq], [wk])
    r = rows_to_dict(rows)
    assert r[(0, 0, "query_weight_participation_ratio")] == pytest.approx(4.0)
    assert r[(0, 0, "interaction_rank")] == pytest.approx(4.0)
    assert r[(0, 0, "interaction_spectral_norm")] == pytest.approx(2.0)
    assert spectra["W_QK_singular_values"].shape == (1, 1, 4)


def test_measure_with_plain_pytorch_hooks_on_a_foreign_model():
    # the README's "bring your own activations" example: torch.nn.MultiheadAttention, which qkgeom
    # does not know, read with plain forward hooks; rows must equal an independent computation
    import qkgeom

    torch.manual_seed(0)
    D, H, T, B = 16, 2, 10, 3
    mha = torch.nn.MultiheadAttention(D, H, batch_first=True, bias=False)
    seen = {}
    hook = mha.register_forward_hook(lambda m, args, out: seen.update(x=args[0], pattern=out[1]))
    x = torch.randn(B, T, D)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    mha(x, x, x, attn_mask=mask, average_attn_weights=False)
    hook.remove()
    w_q, w_k, _ = mha.in_proj_weight.chunk(3)  # (D, D) each, q = x @ w_q.T

    def split(t):
        return t.view(B, T, H, -1).transpose(1, 2)  # (B, T, D) -> (B, H, T, E)

    q, k, pattern = split(seen["x"] @ w_q.T), split(seen["x"] @ w_k.T), seen["pattern"]
    rows = qkgeom.measure(q, k, pattern)
    got = rows.set_index(["layer", "head", "metric"])["value"]
    for h in range(H):
        ref_pr = G.participation_ratio(G.covariance_eigenvalues(k[:, h].reshape(-1, 8).double())).item()
        assert got[(0, h, "key_participation_ratio")] == pytest.approx(ref_pr, rel=1e-9)
        ent, _ = G.attention_entropy(pattern[:, h].double())
        assert got[(0, h, "attention_entropy")] == pytest.approx(ent[:, 1:].mean().item(), rel=1e-6)
    assert {"logit_participation_ratio", "participation_ratio_contrast"} <= set(rows["metric"])


def test_gpt_probe_logit_cap_uses_the_first_sequences_only():
    # the cap changes only the logit rows, and they equal an uncapped probe of those sequences
    from qkgeom import config as C
    from qkgeom.probing.probe import probe_gpt
    from qkgeom.training.model import GPT

    cfg = C.load("tiny")
    model = GPT(cfg.model, vocab_size=50, seed=0).eval()
    idx = torch.randint(0, 50, (6, cfg.model.n_ctx), generator=torch.Generator().manual_seed(0))
    full, capped, first = (
        rows_to_dict(probe_gpt(model, i, C.ProbeSettings(logit_seqs=cap))[0])
        for i, cap in ((idx, None), (idx, 2), (idx[:2], None))
    )
    assert full.keys() == capped.keys()
    n_logit = 0
    for key, v in capped.items():
        if key[2].startswith("logit_"):
            n_logit += 1
            assert v == pytest.approx(first[key], rel=1e-12)
        else:
            assert v == full[key] or (math.isnan(v) and math.isnan(full[key]))  # NaN: an alpha without a fit
    assert n_logit > 0 and any(capped[k] != full[k] for k in capped if k[2].startswith("logit_"))


def test_logit_scale_and_row_std_rows_match_direct_computations():
    """The probe's input_logit_scale is interventions.logit_scale at the probe batch's input mean and
    covariance; logit_row_std and its CV are the per-row std of q.k / sqrt(E) over the keys each causal
    row sees, averaged over rows."""
    from qkgeom.config import ModelConfig
    from qkgeom.probing.hooks import capture
    from qkgeom.probing.probe import gpt_weights, probe_gpt
    from qkgeom.training.maps import logit_scale
    from qkgeom.training.model import GPT

    model = GPT(ModelConfig(n_layers=2, d_model=32, n_heads=4, n_ctx=16), 40, seed=3)
    idx = torch.randint(0, 40, (8, 16), generator=torch.Generator().manual_seed(0))
    r = rows_to_dict(probe_gpt(model, idx, C.ProbeSettings(logit_seqs=None))[0])  # the row stds of all 8
    names = ["blocks.1.hook_attn_in", "blocks.1.attn.hook_q", "blocks.1.attn.hook_k"]
    with torch.no_grad(), capture(model, names) as store:
        model(idx, explicit=True)
    x = store[names[0]].reshape(-1, 32).double()
    w_q, w_k = gpt_weights(model)
    expected = logit_scale(w_q[1], w_k[1], torch.cov(x.T, correction=0), x.mean(0)).detach()
    for h in range(4):
        assert r[(1, h, "input_logit_scale")] == pytest.approx(float(expected[h]), rel=1e-6)
    q, k = store[names[1]].double(), store[names[2]].double()  # (B, H, T, E)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    stds = torch.stack([scores[..., t, : t + 1].std(-1, correction=0) for t in range(1, 16)], -1)  # (B, H, T-1)
    per_head = stds.permute(1, 0, 2).reshape(4, -1)
    for h in range(4):
        assert r[(1, h, "logit_row_std")] == pytest.approx(float(per_head[h].mean()), rel=1e-5)
        cv = per_head[h].std(correction=0) / per_head[h].mean()
        assert r[(1, h, "logit_row_std_cv")] == pytest.approx(float(cv), rel=1e-4)


def test_measure_reads_a_sliding_window():
    """measure(..., window=w) for a sliding-window model's activations: each query t sees keys
    t - w < j <= t, so its normalised entropy is over log min(t + 1, w) keys, and the logit row std and
    spectral norm are of the band's scores (numpy on the same q, k); without the window the same pattern
    reads as more peaked than it is. A window on a bidirectional layer, or of no key, is refused."""
    import qkgeom
    from qkgeom.probing.probe import MeasureError

    B, H, T, E, w = 3, 2, 12, 8, 4
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(B, H, T, E, generator=gen, dtype=torch.float64) for _ in range(2))
    band = torch.ones(T, T, dtype=torch.bool).tril().triu(-(w - 1))
    scores = q @ k.transpose(-1, -2) / math.sqrt(E)
    pattern = scores.masked_fill(~band, float("-inf")).softmax(-1)
    got = qkgeom.measure(q, k, pattern, window=w).set_index(["layer", "head", "metric"])["value"]
    plain = qkgeom.measure(q, k, pattern).set_index(["layer", "head", "metric"])["value"]
    s, seen = scores.numpy(), band.numpy()
    for h in range(H):
        p = pattern[:, h].numpy()
        ent = -(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0)).sum(-1)  # (B, T)
        norm = np.mean([ent[b, t] / math.log(min(t + 1, w)) for b in range(B) for t in range(1, T)])
        row_std = np.mean([np.std(s[b, h, t, seen[t]]) for b in range(B) for t in range(1, T)])
        top = np.mean([np.linalg.svd(np.where(seen, s[b, h], 0.0), compute_uv=False)[0] for b in range(B)])
        assert got[(0, h, "attention_entropy_normalised")] == pytest.approx(norm, rel=1e-9)
        assert got[(0, h, "logit_row_std")] == pytest.approx(row_std, rel=1e-9)
        assert got[(0, h, "logit_spectral_norm")] == pytest.approx(top, rel=1e-6)  # a float32 eigen-solve
        assert got[(0, h, "attention_entropy")] == plain[(0, h, "attention_entropy")]  # nats: no support in it
        assert plain[(0, h, "attention_entropy_normalised")] < 0.95 * norm  # log(t + 1) > log w past the window
    for bad, causal in ((0, True), (4, False), (2.5, True)):
        with pytest.raises(MeasureError, match="window must be a positive number of keys, on a causal"):
            qkgeom.measure(q, k, None if not causal else pattern, causal=causal, window=bad)


def test_alpha_rows_per_head_and_layer_with_reasons_for_bad_heads():
    """alpha of every head's W_Q, W_K, W_Q W_K^T, W_V, W_O (and each layer's whole matrix at head -1)
    is power_law_alpha of the squared singular values; an all-zero, a rank-one and a non-finite head
    give NaN with their reason, never a crash; too few tail eigenvalues give NaN with that reason; every
    alpha row's note names its convention."""
    import warnings

    from qkgeom.probing.probe import ALPHA_METRICS

    g = torch.Generator().manual_seed(0)
    h, d, e = 4, 64, 32
    w_q = torch.randn(h, d, e, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3, e, dtype=torch.float64) ** 2
    w_k = torch.randn(h, d, e, generator=g, dtype=torch.float64)
    w_k[1] = 0.0  # all zero
    w_k[2] = torch.randn(d, 1, generator=g, dtype=torch.float64) @ torch.randn(1, e, generator=g, dtype=torch.float64)
    w_v = torch.randn(h, d, e, generator=g, dtype=torch.float64)
    w_v[3, 0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows, _ = weight_geometry([w_q], [w_k], w_v=[w_v], w_o=[w_q.clone()])
    r = {(x["head"], x["metric"]): (x["value"], x.get("note", "")) for x in rows if x["metric"].endswith("_alpha")}
    assert {m for _, m in r} == set(ALPHA_METRICS.values())
    for head in range(h):
        expected = AL.power_law_alpha(torch.linalg.svdvals(w_q[head]) ** 2)["alpha"]
        assert r[(head, "query_weight_alpha")][0] == pytest.approx(expected, rel=1e-9)
    whole = w_q.permute(1, 0, 2).reshape(d, -1)
    assert r[(-1, "query_weight_alpha")][0] == pytest.approx(
        AL.power_law_alpha(torch.linalg.svdvals(whole) ** 2)["alpha"]
    )
    ww = "alpha=weightwatcher"
    assert math.isnan(r[(1, "key_weight_alpha")][0]) and r[(1, "key_weight_alpha")][1] == f"{ww}; all-zero matrix"
    assert math.isnan(r[(2, "key_weight_alpha")][0]) and r[(2, "key_weight_alpha")][1] == f"{ww}; rank one"
    assert math.isnan(r[(3, "value_weight_alpha")][0]) and r[(3, "value_weight_alpha")][1] == f"{ww}; non-finite values"
    assert math.isfinite(r[(0, "key_weight_alpha")][0]) and r[(0, "key_weight_alpha")][1] == ww
    # an 8-dim head has too few eigenvalues for a tail of 10 under `clauset`
    from qkgeom.config import Conventions

    small, _ = weight_geometry([w_q[:, :, :8]], [w_k[:, :, :8]], conventions=Conventions(alpha="clauset"))
    alpha = [x for x in small if x["metric"] == "query_weight_alpha" and x["head"] == 0][0]
    assert math.isnan(alpha["value"]) and alpha["note"].startswith("alpha=clauset; fewer than 10 eigenvalues")


@pytest.mark.usefixtures("wikitext")
def test_a_runs_geometry_table_carries_alpha_with_its_note(tmp_path):
    from qkgeom.training.loop import train
    from tests.conftest import tiny_config

    g = train(tiny_config(train={"steps": 10}), tmp_path / "r", progress=False).read_geometry()
    assert list(g.columns)[-1] == "note" and str(g["note"].dtype) == "string"
    a = g[g.metric == "value_weight_alpha"]
    # E = 8: WeightWatcher's small-sample fit (its min_evals is 8); the whole 32 x 32 matrix: its standard fit
    assert a["value"].notna().all() and (a["note"] == "alpha=weightwatcher").all()
    cfg = tiny_config(train={"steps": 10}, probe={"alpha_convention": "clauset"})
    g = train(cfg, tmp_path / "c", progress=False).read_geometry()
    a = g[g.metric == "value_weight_alpha"]
    per_head, layer = a[a["head"] >= 0], a[a["head"] == -1]
    assert per_head["value"].isna().all() and per_head["note"].str.startswith("alpha=clauset; fewer than 10").all()
    assert layer["value"].notna().all() and (layer["note"] == "alpha=clauset").all()
    assert (g[g.metric == "key_participation_ratio"]["note"] == "pr=variance").all()


def test_pr_convention_on_an_analytic_case_and_recorded_in_every_pr_row():
    """Keys whose covariance has eigenvalues (4, 1) (singular values (2, 1)) and a W_K with singular
    values (2, 1): PR 25/17 under `variance`, (2 + 1)^2 / 5 = 1.8 under `singular`; the note says which."""
    from qkgeom import config as C
    from qkgeom.probing.probe import measure

    z = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)  # cov = I
    k = (z * torch.tensor([2.0, 1.0], dtype=torch.float64)).reshape(1, 1, 4, 2)  # cov = diag(4, 1)
    q = torch.randn(1, 1, 4, 2, dtype=torch.float64)
    w = torch.zeros(1, 3, 2, dtype=torch.float64)
    w[0, 0, 0], w[0, 1, 1] = 2.0, 1.0
    for conv, pr in (("variance", 25 / 17), ("singular", 1.8)):
        df = measure(q, k, causal=False, w_q=[w], w_k=[w], pr_convention=conv)
        row = df[(df.metric == "key_participation_ratio") & (df["head"] == 0)].iloc[0]
        assert row["value"] == pytest.approx(pr) and row["note"] == f"pr={conv}"
        wrow = df[(df.metric == "key_weight_participation_ratio") & (df["head"] == 0)].iloc[0]
        assert wrow["value"] == pytest.approx(pr) and wrow["note"] == f"pr={conv}"
        prs = df[df.metric.str.contains("participation_ratio") | (df.metric == "interaction_rank")]
        assert prs["note"].str.startswith("pr=").all()  # every PR row names its convention
        assert df[df.metric == "key_effective_rank"]["note"].isna().all()
    with pytest.raises(ValueError, match="pr_convention must be one of .* got 'eigen'"):
        measure(q, k, pr_convention="eigen")
    with pytest.raises(C.ConfigError, match="probe.pr_convention must be one of"):
        C.load("tiny", ["probe.pr_convention='eigen'"])
    # one door: the alpha convention is checked by the same value (config.Conventions), wherever set
    with pytest.raises(C.ConfigError, match="probe.alpha_convention must be one of .* got 'hill'"):
        C.load("tiny", ["probe.alpha_convention='hill'"])
    with pytest.raises(ValueError, match="alpha_convention must be one of"):
        measure(q, k, alpha_convention="hill")


@pytest.mark.usefixtures("wikitext")
def test_a_training_run_under_the_singular_convention(tmp_path):
    from qkgeom.training.loop import train
    from tests.conftest import tiny_config

    rd = train(tiny_config(train={"steps": 4}, probe={"pr_convention": "singular"}), tmp_path / "s", progress=False)
    g = rd.read_geometry()
    pr = g[(g.metric == "key_participation_ratio") & (g["head"] == 0) & (g.step == 4)]
    eig = torch.as_tensor(rd.read_spectra()["key_head_eigenvalues"][-1, 0, 0])
    assert pr["value"].iloc[0] == pytest.approx(float(G.participation_ratio(eig.sqrt())), rel=1e-6)
    assert set(pr["note"]) == {"pr=singular"}


def test_weight_spectra_solved_together_equal_one_svd_per_matrix(monkeypatch):
    """weight_geometry solves every layer's per-head and whole matrices in batches (chunked by size):
    the rows equal those from one SVD per matrix, whatever the chunk size."""
    g = torch.Generator().manual_seed(5)
    w = [[torch.randn(h, 48, 12, generator=g) * 0.05 for _ in range(3)] for h in (4, 2, 2, 4)]  # GQA: 4 / 2
    w_q, w_k, w_v, w_o = w
    first, _ = weight_geometry(w_q, w_k, w_v=w_v, w_o=w_o)
    monkeypatch.setattr(W, "_BATCH_ELEMENTS", 600)  # one matrix per chunk
    second, _ = weight_geometry(w_q, w_k, w_v=w_v, w_o=w_o)
    a, b = rows_to_dict(first), rows_to_dict(second)
    assert a.keys() == b.keys() and len(a) > 100
    np.testing.assert_allclose([a[key] for key in a], [b[key] for key in a], rtol=1e-12, equal_nan=True)
    sv = torch.linalg.svdvals(w_k[1].double())  # layer 1's key heads, by an SVD
    pr = (sv**2).sum(-1) ** 2 / (sv**4).sum(-1)
    for h in range(2):
        assert a[(1, h, "key_weight_participation_ratio")] == pytest.approx(float(pr[h]), rel=1e-10)
    whole = torch.linalg.svdvals(W._whole(w_q[2]).double())
    expected = AL.power_law_alpha(whole**2)["alpha"]
    assert math.isfinite(expected) and a[(2, -1, "query_weight_alpha")] == pytest.approx(expected, rel=1e-9)


def test_streamed_layers_hold_their_logit_sequences_for_one_solve_at_rows(monkeypatch):
    """update_layer (the probe's streaming path) keeps copies of each layer's logit sequences and makes no
    round trip to the host; rows() solves every layer together: 4 round trips for 4 layers (the logit
    Grams, the two triangular factors and the SVD of the centred logits), where a layer at a time took
    16. Held past the budget (_HELD_SCORES), they are solved as they come, to the same rows bit for bit."""
    from qkgeom import solves as S
    from qkgeom.probing import probe as P

    g = torch.Generator().manual_seed(6)
    B, H, T, E = 3, 2, 16, 4
    batch = [(torch.randn(B, H, T, E, generator=g), torch.randn(B, H, T, E, generator=g)) for _ in range(4)]
    support = torch.arange(1, T + 1).expand(B, T)
    trips: list[int] = []
    real = S.round_trip
    monkeypatch.setattr(S, "round_trip", lambda *a, **k: trips.append(1) or real(*a, **k))

    def streamed() -> tuple[dict, int, int]:
        acc = GeometryAccumulator(settings=C.ProbeSettings(logit_seqs=2))
        trips.clear()
        for li, (q, k) in enumerate(batch):
            acc.update_layer(li, q, k, None, support)
        while_streaming = len(trips)
        rows = rows_to_dict(acc.rows())
        return rows, while_streaming, len(trips)

    held, streaming, total = streamed()
    assert streaming == 0
    solves_of_covariances = 2  # every layer's covariances, then their per-head blocks
    assert total - solves_of_covariances == 4
    monkeypatch.setitem(P._HELD_SCORES, "cpu", 1)  # each layer solved as it comes
    alone, streaming, total = streamed()
    assert streaming == 16 and total - solves_of_covariances == 16
    assert held.keys() == alone.keys() and all(held[k] == alone[k] for k in held)


def test_logit_spectra_of_all_layers_solved_together_equal_one_layer_at_a_time():
    """update() stacks the layers for the logit statistics; the rows equal update_layer() layer by
    layer, also when the logit cap (5 sequences) is reached inside the second batch, and the logit PR
    and spectral norm equal a float64 SVD of the causal scores of exactly the first 5 sequences."""
    g = torch.Generator().manual_seed(4)
    n_layers, B, H, T, E = 3, 3, 2, 12, 4

    def layers() -> list[torch.Tensor]:
        return [torch.randn(B, H, T, E, generator=g) for _ in range(n_layers)]

    batches = [(layers(), layers()) for _ in range(2)]
    five = C.ProbeSettings(logit_seqs=5)
    together, alone = GeometryAccumulator(settings=five), GeometryAccumulator(settings=five)
    support = torch.arange(1, T + 1).expand(B, T)
    for qs, ks in batches:
        together.update(QKSnapshot(q=qs, k=ks, pattern=[None] * n_layers))
        for li in range(n_layers):
            alone.update_layer(li, qs[li], ks[li], None, support)
    a, b = rows_to_dict(together.rows()), rows_to_dict(alone.rows())
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == b[key] or (math.isnan(a[key]) and math.isnan(b[key])), key
    for li in range(n_layers):
        q = torch.cat([qs[li] for qs, _ in batches])[:5].double()
        k = torch.cat([ks[li] for _, ks in batches])[:5].double()
        sv = torch.linalg.svdvals(torch.tril(q @ k.transpose(-1, -2) / math.sqrt(E)))  # (5, H, T)
        pr = (sv**2).sum(-1) ** 2 / (sv**4).sum(-1)
        for h in range(H):
            assert a[(li, h, "logit_participation_ratio")] == pytest.approx(float(pr[:, h].mean()), rel=1e-5)
            assert a[(li, h, "logit_spectral_norm")] == pytest.approx(float(sv[:, h, 0].mean()), rel=1e-5)


def _gpt_and_batch():
    from qkgeom.training.model import GPT

    cfg = C.load("tiny", ["model.d_model=64", "model.n_heads=4"])
    model = GPT(cfg.model, 50, seed=0).eval()
    return model, torch.randint(0, 50, (8, cfg.model.n_ctx), generator=torch.Generator().manual_seed(0))


def _reduced_fp32_matmul_here() -> bool:
    """Whether float32 matmul precision "medium" changes a product on this CPU (bf16 arithmetic, as on
    AMX or AVX-512 BF16 CPUs): the CPU's counterpart of the TF32 a GPU trainer allows."""
    x, w = torch.randn(64, 256), torch.randn(256, 256)
    exact = x @ w
    torch.set_float32_matmul_precision("medium")
    try:
        return not torch.equal(x @ w, exact)
    finally:
        torch.set_float32_matmul_precision("highest")


@pytest.mark.parametrize("api", ["legacy", "per-backend"])
def test_the_probe_measures_in_full_float32_whatever_the_training_allows(api):
    """A trainer may allow reduced-precision float32 matmuls (TF32 on a GPU, as qkgeom's trainer and
    nanoGPT do; bf16 on a CPU with bf16 arithmetic): the probe's rows are those of full float32, bit for
    bit, and the setting comes back after, through whichever of torch's two APIs set it."""
    per_backend = hasattr(torch.backends.mkldnn, "matmul")
    if api == "per-backend" and not per_backend:
        pytest.skip(f"torch {torch.__version__} has no per-backend float32 matmul precision (2.9 brought it)")
    if not _reduced_fp32_matmul_here():
        pytest.skip("float32 matmul precision has no reduced mode on this CPU (no bf16 arithmetic)")
    from qkgeom.probing.probe import probe_gpt

    model, idx = _gpt_and_batch()
    exact, _ = probe_gpt(model, idx)
    try:
        if api == "legacy":
            torch.set_float32_matmul_precision("medium")
        else:
            torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        reduced, _ = probe_gpt(model, idx)
        if api == "legacy":
            assert torch.get_float32_matmul_precision() == "medium"
        else:
            assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
    finally:
        if per_backend:
            torch.backends.mkldnn.matmul.fp32_precision = "ieee"
        torch.set_float32_matmul_precision("highest")
    assert rows_to_dict(reduced) == rows_to_dict(exact)


def test_the_probe_measures_in_full_float32_inside_autocast():
    """Called inside a bf16 autocast region (a training loop's), the probe's forward is not autocast."""
    from qkgeom.probing.probe import probe_gpt

    model, idx = _gpt_and_batch()
    exact, _ = probe_gpt(model, idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside, _ = probe_gpt(model, idx)
        assert torch.is_autocast_enabled("cpu")  # the caller's region is left as it was
    assert rows_to_dict(inside) == rows_to_dict(exact)
