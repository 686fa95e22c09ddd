"""StreamedLM against plain HF on the same weights: per-token log-probs equal HF's fp32
log-softmax, greedy generation equals HF `generate(do_sample=False)` on left-padded batches,
KV-cache decoding equals recomputing the whole sequence without a cache, and sampling is
reproducible by seed (top_p tiny is greedy).

Reference: an independent HF model holding a copied state_dict (`engine_helpers.model_pair`),
run by HF's own forward and generate. Families: Llama (every weight mode), Qwen3.5 (hybrid
Gated-DeltaNet + full attention: a recurrent cache beside the KV cache) and Qwen3-MoE.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from engine_helpers import model_pair  # noqa: E402
from test_families import FAMILIES, family_config  # noqa: E402

from lazytrain.evaluation.streamed_lm import StreamedLM  # noqa: E402
from lazytrain.runtime.backends import make_device  # noqa: E402

EOS, PAD = 5, 0
SEQUENCES = [[1, 2, 3, 4, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18], [19, 20]]
PROMPTS = [[1, 2, 3], [4, 6, 7, 8, 9], [10], [11, 12, 13, 14]]
NEW_TOKENS = 6
CASES = [("llama", "host", "cpu"), ("llama", "streamed", "cpu-checked"),
         ("llama", "resident", "cpu-checked"), ("qwen3_5_text", "streamed", "cpu"),
         ("qwen3_moe", "streamed", "cpu")]
IDS = [f"{f}-{m}-{d}" for f, m, d in CASES]


class _Tokenizer:
    """The two ids StreamedLM reads from a tokenizer."""

    eos_token_id = EOS
    pad_token_id = PAD


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def pair(request):
    """(reference HF model in eval mode, StreamedLM on a copy of its weights)."""
    family, mode, device = request.param
    ref, adapter = model_pair(family_config(family))
    ref.eval()
    # 3 of 4 rows: one full batch and one short one; the checker sees every op when booked
    lm = StreamedLM(adapter, _Tokenizer(), device=make_device(device), weights=mode,
                    batch_size=3, book_compute=device == "cpu-checked")
    yield ref, lm
    lm.close()


def _hf_logprobs(ref, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = ref(torch.tensor([seq])).logits.float()[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]


def test_token_logprobs_equal_hf_log_softmax(pair):
    ref, lm = pair
    got = lm.token_logprobs(SEQUENCES)
    for seq, lp in zip(SEQUENCES, got):
        assert lp.dtype == torch.float32 and lp.shape == (len(seq) - 1,)
        torch.testing.assert_close(lp, _hf_logprobs(ref, seq), rtol=1e-5, atol=1e-5)


def _hf_generate(ref, prompts: list[list[int]], *, batch: int) -> list[list[int]]:
    """HF greedy generation, left-padded `batch` prompts at a time, cut after EOS."""
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[PAD] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        gen = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                           do_sample=False, pad_token_id=PAD, eos_token_id=EOS)[:, width:]
        for row in gen.tolist():
            out.append(row[:row.index(EOS) + 1] if EOS in row else row)
    return out


def test_greedy_generation_equals_hf_generate(pair):
    ref, lm = pair
    assert lm.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == _hf_generate(
        ref, PROMPTS, batch=lm.batch_size)


def test_cached_decoding_equals_recomputing_without_a_cache(pair):
    """Each greedy token is the argmax of HF's no-cache forward over prompt + tokens so far."""
    ref, lm = pair
    got = lm.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    for prompt, new in zip(PROMPTS, got):
        seq = list(prompt)
        for _ in range(NEW_TOKENS):
            with torch.no_grad():
                logits = ref(torch.tensor([seq]), use_cache=False).logits[0, -1]
            seq.append(int(logits.argmax()))
            if seq[-1] == EOS:
                break
        assert new == seq[len(prompt):]


def test_sampling_is_reproducible_by_seed_and_tiny_top_p_is_greedy(pair):
    _, lm = pair
    kw = dict(max_new_tokens=NEW_TOKENS, temperature=1.5)
    first = lm.generate(PROMPTS, seed=7, **kw)
    assert lm.generate(PROMPTS, seed=7, **kw) == first
    # 4 prompts x 6 tokens over a 96-token vocabulary at T = 1.5: two seeds agreeing on every
    # token is practically impossible
    assert lm.generate(PROMPTS, seed=8, **kw) != first
    greedy = lm.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    assert lm.generate(PROMPTS, seed=3, top_p=1e-6, **kw) == greedy


def test_generation_stops_at_the_stop_callback_and_at_max_new_tokens(pair):
    _, lm = pair
    full = lm.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    cut = lm.generate(PROMPTS, max_new_tokens=NEW_TOKENS, stop=lambda new: len(new) == 2)
    assert cut == [row[:2] for row in full]
    assert lm.generate(PROMPTS, max_new_tokens=0) == [[] for _ in PROMPTS]


def test_bad_arguments_are_refused_naming_them(pair):
    _, lm = pair
    with pytest.raises(ValueError, match="top_p"):
        lm.generate(PROMPTS, max_new_tokens=2, top_p=0)
    with pytest.raises(ValueError, match="max_length"):
        lm.token_logprobs([[1]])


def test_generation_ends_at_an_eos_token_and_includes_it(pair):
    _, lm = pair
    full = lm.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    saved = lm.eos_token_ids
    eos = full[1][1]  # row 1's second token becomes an end of sequence
    lm.eos_token_ids = {eos}
    try:
        got = lm.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    finally:
        lm.eos_token_ids = saved
    assert got[1] == full[1][:full[1].index(eos) + 1]  # up to its first occurrence


def test_from_run_dir_loads_the_newest_complete_checkpoint_with_its_tokenizer(tmp_path):
    """Two step directories, the newer one without its COMPLETE marker (a crashed save):
    the older one is loaded, and scores as HF's from_pretrained of that directory does."""
    from tiny_models import tiny_model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = ["the cat sat on the mat", "a dog ran in the park"] * 20
    done = tiny_model_dir(tmp_path / "run" / "checkpoints" / "step-000002", texts)
    (done / "COMPLETE").write_text("{}")
    tiny_model_dir(tmp_path / "run" / "checkpoints" / "step-000004", texts, layers=2)
    lm = StreamedLM.from_run_dir(tmp_path / "run")
    tok = AutoTokenizer.from_pretrained(done)
    ref = AutoModelForCausalLM.from_pretrained(done, dtype=torch.float32).eval()
    seq = tok("the cat ran in the park")["input_ids"]
    assert lm.tokenizer.get_vocab() == tok.get_vocab() and lm.adapter.num_blocks == 3
    torch.testing.assert_close(lm.token_logprobs([seq])[0], _hf_logprobs(ref, seq),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        StreamedLM.from_run_dir(tmp_path)


def test_the_ledger_books_one_load_of_the_model_per_streamed_pass():
    """Streamed: the ends once, then every block once per pass of token_logprobs (all 4
    sequences share one pass): the HF model's parameters x 4 B (fp32), on the h2d channel of
    the window "eval"."""
    ref, adapter = model_pair(family_config("llama"))
    lm = StreamedLM(adapter, _Tokenizer(), device=make_device("cpu"), weights="streamed",
                    batch_size=3)
    lm.token_logprobs(SEQUENCES)
    model_bytes = 4 * sum(p.numel() for p in ref.parameters())
    assert lm.dev.ledger.moved_by_window()["eval"]["h2d"] == model_bytes
    lm.token_logprobs(SEQUENCES)  # the ends stay on the device; the blocks stream again
    ends = 4 * sum(p.numel() for n, p in ref.named_parameters() if ".layers." not in n)
    assert lm.dev.ledger.moved_by_window()["eval"]["h2d"] == 2 * model_bytes - ends


def test_a_pass_that_fails_returns_every_weight_slot(monkeypatch):
    """An error inside a streamed pass (here: block 1) frees the running block's slot and the
    prefetched one: the next pass finds both slots free (shared engine slots stay usable)."""
    _, adapter = model_pair(family_config("llama"))
    lm = StreamedLM(adapter, _Tokenizer(), device=make_device("cpu"), weights="streamed")
    real = adapter.forward_block

    def failing(j, *args, **kwargs):
        if j == 1:
            raise RuntimeError("block 1 failed")
        return real(j, *args, **kwargs)

    monkeypatch.setattr(adapter, "forward_block", failing)
    with pytest.raises(RuntimeError, match="block 1 failed"):
        lm.token_logprobs(SEQUENCES)
    assert sorted(lm._slots.free) == [0, 1]
    monkeypatch.setattr(adapter, "forward_block", real)
    assert len(lm.token_logprobs(SEQUENCES)) == len(SEQUENCES)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_scores_and_generates_as_hf(family):
    """Every supported family (sliding windows shorter than prompt + new tokens, soft-capped
    logits, MLA, attention sinks, recurrent layers, MoE) through the streamed weight path."""
    ref, adapter = model_pair(family_config(family))
    ref.eval()
    lm = StreamedLM(adapter, _Tokenizer(), device=make_device("cpu"), weights="streamed",
                    batch_size=4)
    for seq, lp in zip(SEQUENCES, lm.token_logprobs(SEQUENCES)):
        torch.testing.assert_close(lp, _hf_logprobs(ref, seq), rtol=1e-5, atol=1e-5)
    assert lm.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == _hf_generate(ref, PROMPTS,
                                                                          batch=4)


def test_refresh_gives_the_device_copies_back_and_the_next_pass_reads_new_masters():
    """Resident: a pass leaves every block and the ends on the device (the model's fp32 bytes
    beside the two slots); refresh frees them, and a pass after the masters changed scores
    with the new weights (HF on the same change as reference)."""
    ref, adapter = model_pair(family_config("llama"))
    ref.eval()
    lm = StreamedLM(adapter, _Tokenizer(), device=make_device("cpu"), weights="resident")
    ledger = lm.dev.ledger
    lm.token_logprobs(SEQUENCES[:1])
    model_bytes = 4 * sum(p.numel() for p in ref.parameters())
    slots = 2 * 4 * max(g.numel for g in adapter.params.blocks)
    assert ledger.held_bytes("hbm") == model_bytes + slots
    lm.refresh()
    assert ledger.held_bytes("hbm") == slots
    with torch.no_grad():  # one "training step": every weight moves, in both copies
        for p in ref.parameters():
            p.mul_(1.5)
        for g in [*adapter.params.blocks, adapter.params.ends]:
            g.master.mul_(1.5)
    torch.testing.assert_close(lm.token_logprobs(SEQUENCES[:1])[0],
                               _hf_logprobs(ref, SEQUENCES[0]), rtol=1e-5, atol=1e-5)
