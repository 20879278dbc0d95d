"""CLI runs of the inference tools on a torch_dist checkpoint (the default format) trained at tp=2 x pp=2
(mock data, vocabulary 500), read at other layouts: Hugging Face conversion both ways, generate.py (one
process and torchrun tp=2) against HF greedy, the HTTP server at tp=2 with valid and invalid requests,
evaluate.py (one process and dp=2) against HF's loss, export.py's program. The torch format's readers
share ``load_full_state`` with these (tests/unit/test_generation_state.py).

The tp=2 generation goes through a real torchrun (the README's command, the suite's one launcher smoke run of a
tool); the checkpoint's training, the server and the other tools run in processes forked from the test harness's
server as torchrun would start them (tests/e2e/cli.py): an agent and a fresh interpreter per worker cost ~3 s of CPU
each before any work."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import transformers  # a test dependency: missing, these tests fail

from megatron_like.inference import load_inference_model
from megatron_like.model.state import load_full_state
from megatron_like.parallel_state import ParallelState
from tests.e2e.cli import launch, run_script, serve, torchrun

VOCAB = 500
PROMPT_IDS = ["3 14 15 92 65", "35 89"]


def run_tool(script: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run_script(f"tools/{script}", *args, check=check, timeout=120)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """Three training iterations at tp=2 x pp=2 (four processes)."""
    root = tmp_path_factory.mktemp("tp2pp2")
    train_flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                   "--mock-data", "--vocab-size", str(VOCAB), "--train-iters", "3", "--num-workers", "0",
                   "--micro-batch-size", "2", "--global-batch-size", "4", "--init-method-std", "0.2",
                   "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--eval-iters", "1",
                   "--save", str(root / "ckpt")]
    launch(4, train_flags)
    assert (root / "ckpt" / "iter_0000003" / ".metadata").exists()  # torch_dist, Megatron's default
    return str(root / "ckpt")


@pytest.fixture(scope="module")
def hf_dir(checkpoint, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("hf") / "model")
    run_tool("convert_hf.py", "to-hf", "--load", checkpoint, "--save", out)
    return out


def our_logits(checkpoint: str, ids: torch.Tensor) -> torch.Tensor:
    loaded = load_inference_model(checkpoint, ParallelState.single_process(torch.device("cpu")))
    with torch.no_grad():
        pos = torch.arange(ids.shape[1])[None].expand_as(ids)
        return loaded.model[0](ids, pos)[..., :VOCAB]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                       pad_token_id=0)[0, len(prompt):].tolist()


def test_hf_conversion_both_ways_keeps_the_logits(checkpoint, hf_dir, tmp_path):
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    assert hf.config.vocab_size == VOCAB and hf.config.n_layer == 2
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = our_logits(checkpoint, ids)
    with torch.no_grad():
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    back = str(tmp_path / "back")
    run_tool("convert_hf.py", "from-hf", "--load", hf_dir, "--save", back, "--tensor-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "2")
    assert sorted(os.listdir(os.path.join(back, "iter_0000000"))) == [".metadata", "__0_0.distcp", "common.pt"]
    _, original = load_full_state(checkpoint)
    _, converted = load_full_state(back)
    assert set(converted) == set(original)
    for name, tensor in original.items():
        rows = min(VOCAB, tensor.shape[0]) if "word_embeddings" in name else tensor.shape[0]
        assert torch.equal(converted[name][:rows], tensor[:rows]), name
    torch.testing.assert_close(our_logits(back, ids), theirs, rtol=1e-5, atol=1e-5)


def test_generate_cli_equals_hf_greedy_in_one_process_and_under_torchrun_tp2(checkpoint, hf_dir):
    flags = ["--load", checkpoint, "--max-new-tokens", "12", "--greedy", "--json"]
    for p in PROMPT_IDS:
        flags += ["--prompt-ids", p]
    single = [json.loads(line) for line in run_tool("generate.py", *flags).stdout.splitlines()]
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    assert [r["token_ids"] for r in single] == [hf_greedy(hf, [int(t) for t in p.split()], 12) for p in PROMPT_IDS]
    out = torchrun(2, [*flags, "--tensor-model-parallel-size", "2"], script="tools/generate.py")
    parallel = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["token_ids"] for r in parallel] == [r["token_ids"] for r in single]

    beams = run_tool("generate.py", "--load", checkpoint, "--prompt-ids", PROMPT_IDS[0], "--max-new-tokens", "6",
                     "--num-beams", "3", "--num-return-sequences", "2", "--json").stdout.splitlines()
    assert [json.loads(line)["sequence"] for line in beams] == [0, 1]
    bad = run_tool("generate.py", "--load", checkpoint, "--prompt", "text needs a tokenizer", check=False)
    assert bad.returncode == 2 and "--prompt-ids" in bad.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def put(port: int, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api", data=body, method="PUT",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_server_under_tp2_answers_valid_requests_and_refuses_invalid_ones(checkpoint, hf_dir):
    port = free_port()
    server = serve(2, checkpoint, port, ["--tensor-model-parallel-size", "2", "--max-prompts", "4",
                                         "--max-prompt-tokens", "24"], timeout=90)
    try:
        valid = json.dumps({"prompts": PROMPT_IDS, "tokens_to_generate": 8, "top_k": 1}).encode()
        status, first = put(port, valid)
        assert status == 200, first
        hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
        assert first["tokens"] == [hf_greedy(hf, [int(t) for t in p.split()], 8) for p in PROMPT_IDS]
        invalid = [
            b"{not json",
            b"[1, 2]",
            json.dumps({"prompts": "3 4", "tokens_to_generate": 4}).encode(),
            json.dumps({"prompts": ["3 4"], "tokens_to_generate": -1}).encode(),
            json.dumps({"prompts": ["3 4"], "tokens_to_generate": "8"}).encode(),
            json.dumps({"prompts": ["3 4"], "tokens_to_generate": 4, "temperature": 0}).encode(),
            json.dumps({"prompts": ["3 4"], "tokens_to_generate": 4, "top_p": 1.5}).encode(),
            json.dumps({"prompts": ["3 4"], "tokens_to_generate": 4, "beam_width": 0}).encode(),
            json.dumps({"prompts": ["3 4"] * 5, "tokens_to_generate": 4}).encode(),
            json.dumps({"prompts": [" ".join(["7"] * 40)], "tokens_to_generate": 4}).encode(),  # > 24 tokens
            json.dumps({"prompts": [" ".join(["7"] * 20)], "tokens_to_generate": 20}).encode(),  # > 32 positions
            json.dumps({"prompts": ["3 4"], "tokens_to_generate": 4, "pad": "x" * (2 << 20)}).encode(),  # > 1 MiB
            json.dumps({"prompts": ["3 999"], "tokens_to_generate": 4}).encode(),
            json.dumps({"prompts": ["3 4"], "tokens_to_generate": 4, "bogus": 1}).encode(),
        ]
        for body in invalid:
            status, reply = put(port, body)
            assert status == 400 and reply["message"], (body, status, reply)
        status, beam = put(port, json.dumps({"prompts": [PROMPT_IDS[0]], "tokens_to_generate": 5,
                                             "beam_width": 2}).encode())
        assert status == 200 and len(beam["scores"]) == 1
        status, sampled = put(port, json.dumps({"prompts": PROMPT_IDS, "tokens_to_generate": 5, "top_p": 0.9,
                                                "temperature": 0.7, "random_seed": 3}).encode())
        assert status == 200 and [len(t) for t in sampled["tokens"]] == [5, 5]
        assert put(port, valid) == (200, first)
    finally:
        server.stop()


def test_evaluate_perplexity_and_lambada_match_hf(checkpoint, hf_dir, tmp_path):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (30,), generator=gen).tolist()
    text = tmp_path / "ids.txt"
    text.write_text(" ".join(map(str, ids)))
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        loss = float(hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss)  # 29 targets in one window
    out = run_tool("evaluate.py", "--load", checkpoint, "--task", "WIKITEXT103", "--valid-data", str(text),
                   "--overlapping-eval", "32").stdout
    reported = float(out.split("| ppl: ")[1].split(" ")[0])
    assert reported == pytest.approx(math.exp(loss), rel=1e-4)

    examples = [torch.randint(0, VOCAB, (8,), generator=gen).tolist() for _ in range(5)]
    with torch.no_grad():  # make two examples "right": their last token is HF's greedy prediction
        for ex in examples[:2]:
            ex[-1] = int(hf(torch.tensor([ex[:-1]])).logits[0, -1].argmax())
        expected = sum(int(hf(torch.tensor([ex[:-1]])).logits[0, -1].argmax()) == ex[-1] for ex in examples)
    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text("".join(json.dumps({"text": " ".join(map(str, ex))}) + "\n" for ex in examples))
    out = run_tool("evaluate.py", "--load", checkpoint, "--task", "LAMBADA", "--valid-data", str(lambada)).stdout
    assert f"number correct: {expected} | total: 5" in out

    # Two data-parallel replicas split the batches (one row each, so both score some): same results.
    small = ["--micro-batch-size", "1", "--load", checkpoint, "--task"]
    windows = [*small, "WIKITEXT103", "--valid-data", str(text), "--eval-seq-length", "12", "--overlapping-eval", "5"]
    one = run_tool("evaluate.py", *windows).stdout
    two = launch(2, windows, script="tools/evaluate.py")
    assert float(two.split("| avg loss: ")[1].split(" ")[0]) == pytest.approx(
        float(one.split("| avg loss: ")[1].split(" ")[0]), rel=1e-6)
    two = launch(2, [*small, "LAMBADA", "--valid-data", str(lambada)], script="tools/evaluate.py")
    assert f"number correct: {expected} | total: 5" in two


def test_export_program_runs_without_our_code_and_equals_the_model(checkpoint, tmp_path):
    run_tool("export.py", "--load", checkpoint, "--save", str(tmp_path / "exported"))
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(2))
    torch.save(ids, tmp_path / "ids.pt")
    script = (  # a fresh interpreter outside the repository, importing torch only
        "import sys, torch;"
        f"p = torch.export.load({str(tmp_path / 'exported' / 'model.pt2')!r}).module();"
        f"torch.save(p(torch.load({str(tmp_path / 'ids.pt')!r}, weights_only=True)), {str(tmp_path / 'out.pt')!r});"
        "assert 'megatron_like' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, timeout=120,
                   env={**os.environ, "PYTHONPATH": ""})
    exported_logits = torch.load(tmp_path / "out.pt", weights_only=True)
    torch.testing.assert_close(exported_logits, our_logits(checkpoint, ids), rtol=1e-5, atol=1e-5)
    meta = json.loads(Path(tmp_path / "exported" / "export_config.json").read_text())
    assert meta["vocab_size"] == VOCAB


def test_text_prompts_through_the_checkpoint_tokenizer_match_hf(tmp_path):
    """A GPT-2-vocabulary model from HF with its BPE files: from-hf records the tokenizer, generate.py
    tokenizes the prompt and prints text equal to HF's greedy continuation."""
    from megatron_like.data.tokenizer import default_gpt2_files

    hf_path = tmp_path / "hf"
    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                  initializer_range=0.2)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(hf_path)
    vocab, merges = default_gpt2_files()
    (hf_path / "vocab.json").write_bytes(Path(vocab).read_bytes())
    (hf_path / "merges.txt").write_bytes(Path(merges).read_bytes())
    run_tool("convert_hf.py", "from-hf", "--load", str(hf_path), "--save", str(tmp_path / "ckpt"))
    out = run_tool("generate.py", "--load", str(tmp_path / "ckpt"), "--prompt", "Hello world", "--max-new-tokens",
                   "6", "--greedy", "--json").stdout
    record = json.loads(out.splitlines()[-1])
    expected = hf.generate(torch.tensor([[15496, 995]]), attention_mask=torch.ones(1, 2, dtype=torch.long),
                           max_new_tokens=6, do_sample=False, pad_token_id=50256)[0, 2:].tolist()
    assert record["token_ids"][: len(expected)] == expected[: len(record["token_ids"])]
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_path)
    shown = [t for t in record["token_ids"] if t != 50256]
    assert record["text"] == tokenizer.decode(shown)

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello world"}\n\n{"text": "A second, longer prompt"}\n')
    run_tool("generate.py", "--load", str(tmp_path / "ckpt"), "--prompts-file", str(prompts), "--max-new-tokens", "6",
             "--greedy", "--json", "--micro-batch-size", "1", "--output", str(tmp_path / "out.jsonl"))
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["Hello world", "A second, longer prompt"]
    assert records[0]["token_ids"] == record["token_ids"]
