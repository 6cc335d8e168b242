"""``scripts/train_tiny_mimo.py``: deterministic (two short runs write identical tensors), its
greedy-chain acceptance arithmetic on known drafts, and the committed trained checkpoints (qk
head dim != v head dim, and ``--spec flash-qkv``'s qk = v): each loads with its MTP layers,
``mmserve tiny-model --arch mimo-trained[-qkv]`` writes it, and it is trained (its drafts agree
with its LM far beyond chance)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llm_svc.loading.loader import load_lm
from mmserve.tiny import mimo_published as mp
from mmserve.tiny_model import TRAINED_MIMO, TRAINED_MIMO_QKV, write_tiny_model

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_tiny_mimo.py"
# (arch, committed directory, v head dim): the hub's qk != v form, and qk = v (vLLM's CPU build serves it)
COMMITTED = [("mimo-trained", TRAINED_MIMO, 16), ("mimo-trained-qkv", TRAINED_MIMO_QKV, 32)]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_tiny_mimo", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def torch_globals():
    """The script sets torch's threads and deterministic mode for its process; restore them."""
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(det)


SHORT = ["--steps", "3", "--batch", "2", "--seq", "40", "--files", "10", "--log-every", "1", "--eval-rows", "2",
         "--eval-prompts", "2", "--eval-prompt-len", "8", "--eval-gen", "12"]


def test_two_short_runs_write_identical_tensors(script, torch_globals, tmp_path):
    for name in ("a", "b"):
        assert script.main(["--out", str(tmp_path / name), *SHORT]) == 0
    a, b = (load_file(str(tmp_path / n / "model.safetensors")) for n in ("a", "b"))
    assert a.keys() == b.keys() and any(k.startswith("model.mtp.layers.2.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = (json.loads((tmp_path / n / "training.json").read_text()) for n in ("a", "b"))
    assert ra["log"] == [{**row, "s": r["s"]} for row, r in zip(rb["log"], ra["log"], strict=True)]
    assert ra["held_out"] == rb["held_out"]
    init = mp.random_tensors(mp.published_shapes(mp.FLASH, a["lm_head.weight"].shape[0]), 0)
    assert a["model.mtp.layers.2.eh_proj.weight"].dtype == torch.bfloat16  # stored as the hub stores it
    assert not torch.equal(a["model.mtp.layers.2.eh_proj.weight"], init["model.mtp.layers.2.eh_proj.weight"].bfloat16())


def test_chain_acceptance_on_known_drafts(script):
    x = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])  # greedy from index 1 on (start = 0)
    right = [torch.arange(2 + i, 13 + i)[None, : 12 - i - 1] for i in range(3)]  # every draft right
    got = script.chain_acceptance(right, x, 0)
    # p = 0: 3 drafts accepted, p = 4: 3 more, p = 8 would need x[8 + 4]: not taken
    assert (got["mean_acceptance_length"], got["verify_steps"], got["acceptance_per_position"]) == (4.0, 2, [1.0] * 3)
    wrong_second = [right[0], right[1] * 0 - 1, right[2]]  # layer 1 never right: layer 2 never reached
    got = script.chain_acceptance(wrong_second, x, 0)
    # p = 0 -> 2 tokens, p = 2, 4, 6, 8 (8 + 3 + 2 <= 11 holds up to p = 6)
    assert (got["mean_acceptance_length"], got["verify_steps"], got["acceptance_per_position"]) == (2.0, 4, [1.0, 0, 0])


def test_qk_eq_v_spec_writes_equal_head_dims(script, torch_globals, tmp_path):
    assert script.main(["--out", str(tmp_path / "q"), "--spec", "flash-qkv", *SHORT]) == 0
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["head_dim"] == cfg["v_head_dim"] == cfg["swa_v_head_dim"] == 32
    assert json.loads((tmp_path / "q" / "training.json").read_text())["settings"]["spec"] == "flash-qkv"


@pytest.mark.parametrize(("arch", "path", "v_dim"), COMMITTED, ids=[c[0] for c in COMMITTED])
def test_committed_checkpoint_loads_with_its_mtp_layers_and_is_trained(arch, path, v_dim):
    lm = load_lm(str(path))
    report = json.loads((path / "training.json").read_text())
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["head_dim"], cfg["v_head_dim"], cfg["torch_dtype"]) == (32, v_dim, "bfloat16")
    assert len(lm.model.mtp) == lm.model.geometry.mtp_layers == 3
    assert report["held_out"]["mean_acceptance_length"] > 1.5 and report["held_out"]["lm_loss"] < 3.0
    ids = lm.tokenizer("def __init__(self, name, value=None):\n        self.", return_tensors="pt")["input_ids"]
    from llm_svc.models.mimo_reference import lm_hidden
    from llm_svc.models.mimo_mtp import chain

    with torch.no_grad():
        for _ in range(24):
            nxt = lm.model.lm_head(lm_hidden(lm.model, ids)[:, -1]).argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        h = lm_hidden(lm.model, ids)
        greedy = lm.model.lm_head(h).argmax(-1)
        first = lm.model.lm_head(chain(lm.model.mtp, lm.model.model.embed_tokens, h, ids)[0]).argmax(-1)
    text = lm.tokenizer.decode(ids[0])
    assert text.isascii() and len(set(text)) > 8, text  # text-like, not random bytes
    agree = float((first[0, :-1] == greedy[0, 1:-1]).float().mean())
    assert agree > 0.3, agree  # a random MTP layer agrees about 1 / vocab of the time


@pytest.mark.parametrize(("arch", "path", "v_dim"), COMMITTED, ids=[c[0] for c in COMMITTED])
def test_tiny_model_writes_the_trained_checkpoint(arch, path, v_dim, tmp_path):
    out = write_tiny_model(tmp_path / "m", arch=arch)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in path.iterdir())
    assert (out / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=f"--arch {arch} is trained with sliding window 128"):
        write_tiny_model(tmp_path / "w", arch=arch, sliding_window=16)
