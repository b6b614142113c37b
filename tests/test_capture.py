"""moesim capture on tiny random-weight models of every supported family (CPU)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moesim.errors import MoesimError  # noqa: E402
from moesim.traces.capture import capture, load_local, moe_layers, router_probs, supported_families  # noqa: E402
from moesim.traces.io import read_trace, write_trace  # noqa: E402
from tests.helpers import too_wide  # noqa: E402
from tests.tiny_models import build, configs  # noqa: E402

PROMPTS = ["w3 w4 w5 w6 w9", "w7 w8", "w10 w11 w12"]
FAMILIES = [t for t in configs() if t in supported_families()]


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    out = {}
    for mt in FAMILIES:
        folder = build(mt, tmp_path_factory.mktemp(mt))
        model, tok = load_local(str(folder), "cpu", "float32")
        res = capture(model, tok, PROMPTS, max_new_tokens=4, batch_size=2, predict_next=True,
                      quasi_hidden=True, keep_hidden=True)
        out[mt] = (model, res)
    return out


@pytest.mark.parametrize("mt", FAMILIES)
def test_recorded_routing_is_what_the_router_computes(captured, mt, tmp_path):
    model, res = captured[mt]
    t, hidden = res.trace, res.hidden
    layers = moe_layers(model)
    assert t.model.num_layers == len(layers)
    # 10 prompt tokens (prefill) + up to 3 prompts x 3 decode steps (4 new tokens, the last not
    # fed back; fewer when a sequence emitted <eos>)
    assert t.take(t.phase == 0).num_tokens() == 10
    assert t.take(t.phase == 1).num_tokens() <= 9
    assert set(np.unique(t.phase).tolist()) <= {0, 1}
    with torch.no_grad():
        for m in layers:
            rows = np.flatnonzero(t.layer == m.ordinal)
            h = torch.tensor(hidden[rows])
            logits, w, idx = m.router(h)
            w, idx = w.float().numpy(), idx.numpy()
            order = np.argsort(-w, axis=1, kind="stable")
            np.testing.assert_array_equal(t.experts[rows], np.take_along_axis(idx, order, axis=1))
            np.testing.assert_allclose(t.weights[rows], np.take_along_axis(w, order, axis=1), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(t.probs[rows], router_probs(mt, logits).numpy(), rtol=1e-5, atol=1e-6)
            if m.ordinal + 1 < len(layers):
                nxt = layers[m.ordinal + 1].router(h)[0]
                np.testing.assert_allclose(t.pred_next[rows], router_probs(mt, nxt).numpy(), rtol=1e-5, atol=1e-6)
    assert t.pred_quasi is not None
    np.testing.assert_allclose(t.pred_quasi.sum(axis=1), 1.0, rtol=1e-4)
    back = read_trace(write_trace(t, tmp_path / "t.parquet"))  # a valid v1 trace
    assert len(back) == len(t)
    assert back.capture["model_type"] == mt


def test_metadata_comes_from_the_model(captured):
    _model, res = captured["qwen2_moe"]
    m = res.trace.model
    assert (m.num_experts, m.top_k, m.hidden_size, m.expert_intermediate_size) == (8, 2, 32, 16)
    assert m.shared_experts == 1
    assert m.renormalize is False
    assert m.expert_bytes["bf16"] == 2 * 3 * 32 * 16  # gate, up, down projections
    assert captured["mixtral"][1].trace.model.renormalize is True
    ds = captured["deepseek_v3"][1].trace.model
    assert ds.num_layers == 2  # the first decoder layer is dense
    assert ds.extra["decoder_layers"] == [1, 2]


def test_positions_and_steps(captured):
    t = captured["olmoe"][1].trace
    first = t.take((t.request == 1) & (t.layer == 0))  # prompt "w7 w8" padded to 5 in its batch
    pre = first.take(first.phase == 0)
    assert pre.position.tolist() == [0, 1]
    dec = first.take(first.phase == 1)
    assert dec.position.tolist() == list(range(2, 2 + len(dec)))
    assert dec.step.tolist() == list(range(1, 1 + len(dec)))


def test_offline_and_unsupported_models_are_refused(tmp_path):
    with pytest.raises(MoesimError, match=r"not a local folder.*would need a download"):
        load_local("allenai/OLMoE-1B-7B-0924", "cpu", "float32")
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                                   num_attention_heads=4)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(MoesimError, match="model type 'llama' is not supported; supported MoE families: OLMoE"):
        load_local(str(tmp_path), "cpu", "float32")


def test_capture_cli(tmp_path):
    import json
    import subprocess
    import sys

    folder = build("mixtral", tmp_path / "m")
    prompts = tmp_path / "p.txt"
    prompts.write_text("w3 w4 w5\nw6 w7\n")
    out = tmp_path / "t.parquet"
    r = subprocess.run([sys.executable, "-m", "moesim", "capture", "--model", str(folder), "--prompts",
                        str(prompts), "--out", str(out), "--precision", "fp32", "--max-new-tokens", "3",
                        "--batch-size", "2", "--predict-next"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    info = json.loads(subprocess.run([sys.executable, "-m", "moesim", "trace", "info", str(out), "--json"],
                                     capture_output=True, text=True).stdout)
    assert info["requests"] == 2
    assert "pred_next" in info["optional_columns"]
    r = subprocess.run([sys.executable, "-m", "moesim", "capture", "--model", str(folder), "--prompts",
                        str(prompts), "--out", str(out), "--precision", "fp32", "--max-new-tokens", "4",
                        "--speculative", "--tree-width", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    info = json.loads(subprocess.run([sys.executable, "-m", "moesim", "trace", "info", str(out), "--json"],
                                     capture_output=True, text=True).stdout)
    assert {"node", "parent", "accepted"} <= set(info["optional_columns"])
    assert "verify" in info["tokens_by_phase"]


@pytest.mark.parametrize("with_draft", [False, True])
def test_speculative_capture_verifies_depth1_trees(tmp_path, with_draft):
    from moesim.traces.capture import capture_speculative

    target, tok = load_local(str(build("olmoe", tmp_path / "t")), "cpu", "float32")
    draft = load_local(str(build("mixtral", tmp_path / "d", seed=3)), "cpu", "float32")[0] if with_draft else None
    spec = capture_speculative(target, tok, ["w3 w4 w5"], max_new_tokens=8, width=3, draft=draft).trace
    plain = capture(target, tok, ["w3 w4 w5"], max_new_tokens=8).trace
    ver = spec.take(spec.phase == 2)
    assert set(ver.node.tolist()) == {1, 2, 3}
    assert set(ver.parent.tolist()) == {0}
    if not with_draft:
        assert ver.accepted[ver.node == 1].all()  # the target's own top candidate is its greedy token
    # what was committed (accepted candidates, or the decode step after a rejection) is plain
    # greedy decoding: same tokens, same routing, position by position
    committed = spec.take(((spec.phase == 2) & spec.accepted) | (spec.phase == 1))
    dec = plain.take(plain.phase == 1)
    compared = 0
    for pos in np.unique(dec.position):
        a = committed.take(committed.position == pos)
        b = dec.take(dec.position == pos)
        if len(a) == 0:
            continue
        compared += 1
        np.testing.assert_array_equal(a.experts, b.experts)
        np.testing.assert_allclose(a.weights, b.weights, rtol=1e-4, atol=1e-5)
    assert compared >= 5
    assert read_trace(write_trace(spec, tmp_path / "s.parquet")).node is not None


def test_token_id_prompts_without_a_tokenizer(tmp_path):
    """Issue 36: a model folder without tokenizer files takes prompts as token ids (transformers
    5.24 would build an empty tokenizer that turns every prompt into no tokens); the prompts'
    ids are what the trace's prefill records (3 and 2 prompt tokens)."""
    folder = build("olmoe", tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink(missing_ok=True)
    model, tok = load_local(str(folder), "cpu", "float32")
    assert tok is None
    res = capture(model, tok, ["5 6 7", "9 10"], max_new_tokens=2, batch_size=1)
    t = res.trace
    prefill = t.phase == 0
    per_request = [len(set(t.position[prefill & (t.request == r)].tolist())) for r in (0, 1)]
    assert per_request == [3, 2]
    with pytest.raises(MoesimError, match="prompt 1 is text but the model folder has no tokenizer"):
        capture(model, tok, ["hello there"], max_new_tokens=2, batch_size=1)


def test_tiny_model_then_capture_from_the_command_line(tmp_path):
    """``moesim tiny-model olmoe DIR`` writes a CPU-sized model a user can capture from with
    the documented command: the trace has the config's shape (3 MoE layers, 8 experts,
    top-2), every prompt word as a prefill token and the decode tokens asked for, and the
    printed lines fit 80 columns."""
    from click.testing import CliRunner

    from moesim.cli import cli

    model = tmp_path / "tiny"
    r = CliRunner().invoke(cli, ["tiny-model", "olmoe", str(model)])
    assert r.exit_code == 0, r.output
    assert (model / "config.json").is_file()
    prompts = tmp_path / "p.txt"
    prompts.write_text("w3 w4 w5 w6\nw7 w8 w9\n")
    out = tmp_path / "t.parquet"
    r2 = CliRunner().invoke(cli, ["capture", "--model", str(model), "--prompts", str(prompts), "--out", str(out),
                                  "--device", "cpu", "--max-new-tokens", "3"])
    assert r2.exit_code == 0, r2.output
    t = read_trace(out)
    assert (t.model.num_layers, t.model.num_experts, t.model.top_k) == (3, 8, 2)
    assert t.take(t.phase == 0).num_tokens() == 7  # 4 + 3 prompt words
    assert t.num_requests == 2
    assert t.take(t.phase == 1).num_tokens() <= 2 * 2  # 3 new tokens: the first from the prefill
    assert not too_wide(r.output + r2.output)
    r3 = CliRunner().invoke(cli, ["tiny-model", "llama", str(tmp_path / "x")])
    assert r3.exit_code == 2
    assert "olmoe" in r3.output
