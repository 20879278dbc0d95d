"""The OpenAI-compatible server at tp=2 with real clients (127.0.0.1 only): the ``openai`` package (completions,
chat with the checkpoint's chat template, streaming, log-probabilities, errors) against the single-process model,
and lm-evaluation-harness (``local-completions`` through ``tools/evaluate.py --harness-url``) against the same
tasks run by the harness's ``hf`` model on the converted Hugging Face checkpoint: same per-example
log-likelihoods, accuracy and generations. The checkpoint: a tiny GPT trained 4 steps on mock data, with a
word-level Hugging Face tokenizer of the ids 0..62 and ``<|endoftext|>``; tasks are local YAML + jsonl files."""

from __future__ import annotations

import json
import os
import random
import runpy
import urllib.request

import openai  # a test dependency: missing, these tests fail
import pytest
import torch

from megatron_like.inference import GenerationParams, generate, load_inference_model
from megatron_like.parallel_state import ParallelState
from tests.distributed.harness import free_port
from tests.e2e.cli import ROOT, in_process_run, run_script, serve

POSITIONS = 32
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}1{% endif %}"


def word_tokenizer(directory: str) -> None:
    """tokenizer.json of the words '0' .. '62' and '<|endoftext|>' (63), and a chat template beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {str(i): i for i in range(63)} | {"<|endoftext|>": 63}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "unk_token": "<|endoftext|>", "model_max_length": POSITIONS, "chat_template": CHAT_TEMPLATE}, f)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("served"))
    word_tokenizer(f"{root}/tokenizer")
    in_process_run(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
                    "--vocab-size", "64", "--max-position-embeddings", str(POSITIONS), "--train-iters", "4",
                    "--lr", "1e-2", "--init-method-std", "0.3", "--tokenizer-type", "HuggingFaceTokenizer",
                    "--tokenizer-model", f"{root}/tokenizer", "--save", f"{root}/ckpt", "--ckpt-format", "torch",
                    "--eval-iters", "0"])
    port = free_port()
    server = serve(2, f"{root}/ckpt", port, ["--tensor-model-parallel-size", "2", "--max-batch-size", "4",
                                             "--served-model-name", "tiny"])
    yield root, port
    server.stop()


@pytest.fixture(scope="module")
def reference(served):
    """The checkpoint in this process (one rank): greedy tokens and log-probabilities to compare with."""
    return load_inference_model(f"{served[0]}/ckpt", ParallelState.single_process(torch.device("cpu")))


def greedy(loaded, ids: list[int], n: int) -> list[int]:
    tokens = generate(loaded.model, [ids], GenerationParams(max_new_tokens=n), eod=loaded.eod,
                      vocab_size=loaded.vocab_size)[0][0].token_ids
    return [t for t in tokens if t != loaded.eod]


def log_probs(loaded, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` log-probabilities of the next token at each position (full forward)."""
    with torch.no_grad():
        logits = loaded.model[0](torch.tensor([ids]), torch.arange(len(ids))[None])[0, :, : loaded.vocab_size]
    return logits.float().log_softmax(-1)


def test_openai_client_completions_chat_streaming_logprobs_and_errors(served, reference):
    root, port = served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
        assert json.load(response) == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["tiny"]
    text = reference.tokenizer.detokenize

    expected = greedy(reference, [5, 9, 13], 5)
    answer = client.completions.create(model="tiny", prompt="5 9 13", max_tokens=5, temperature=0)
    assert answer.choices[0].text == text(expected)
    assert answer.usage.prompt_tokens == 3 and answer.usage.completion_tokens == len(expected)
    assert answer.choices[0].finish_reason == ("length" if len(expected) == 5 else "stop")
    streamed = list(client.completions.create(model="tiny", prompt="5 9 13", max_tokens=5, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text(expected)
    assert streamed[-1].choices[0].finish_reason == answer.choices[0].finish_reason

    # Token-id prompts, n choices each, seeded: the same request gives the same samples.
    sampled = [client.completions.create(model="tiny", prompt=[[5, 9, 13], [7, 8]], n=2, max_tokens=4, seed=5,
                                         temperature=1.0) for _ in range(2)]
    assert sorted(c.index for c in sampled[0].choices) == [0, 1, 2, 3]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]

    ids = [5, 9, 13, 2]
    scored = client.completions.create(model="tiny", prompt="5 9 13 2", max_tokens=1, temperature=0, logprobs=2,
                                       echo=True)
    logprobs = scored.choices[0].logprobs
    logp = log_probs(reference, ids)
    assert logprobs.token_logprobs[0] is None and logprobs.tokens[:4] == ["5", "9", "13", "2"]
    torch.testing.assert_close(torch.tensor(logprobs.token_logprobs[1:4]),
                               logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1), atol=1e-4, rtol=1e-4)
    best = logp[-1].topk(2)
    assert logprobs.tokens[4] == text([int(best.indices[0])])  # greedy: the most likely next token
    assert logprobs.top_logprobs[4] == pytest.approx({text([int(i)]): float(v) for v, i in zip(*best)}, abs=1e-4)

    # Chat: the template of the tokenizer's tokenizer_config.json renders "5 9 13 1".
    expected = greedy(reference, [5, 9, 13, 1], 4)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "5 9 13"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    assert chat.choices[0].message.content == text(expected) and chat.usage.prompt_tokens == 4
    assert [e.token for e in chat.choices[0].logprobs.content] == [text([t]) for t in expected]
    pieces = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "5 9 13"}],
                                            max_tokens=4, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == text(expected)

    for kwargs, message in [({"max_tokens": -1}, "max_tokens -1 must be in"),
                            ({"extra_body": {"bogus": 1}}, "unsupported field(s) bogus"),
                            ({"prompt": "1 " * 40}, "40 tokens"),
                            ({"presence_penalty": 0.5}, "presence_penalty is not supported")]:
        with pytest.raises(openai.BadRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
            client.completions.create(**{"model": "tiny", "prompt": "5", **kwargs})


TASKS = {
    "tiny_choice": {"output_type": "multiple_choice", "doc_to_text": "{{query}}", "doc_to_choice": "choices",
                    "doc_to_target": "gold", "metric_list": [{"metric": "acc"}]},
    "tiny_rolling": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{query}}",
                     "metric_list": [{"metric": "word_perplexity"}]},
    "tiny_generate": {"output_type": "generate_until", "doc_to_text": "{{query}}", "doc_to_target": "{{choices[0]}}",
                      "generation_kwargs": {"until": ["<|endoftext|>"], "max_gen_toks": 4, "do_sample": False},
                      "metric_list": [{"metric": "exact_match"}]},
}


def write_tasks(directory: str) -> None:
    """A jsonl of 8 examples and one YAML per task over it (json is written as YAML)."""
    rng = random.Random(0)
    docs = [{"query": " ".join(str(rng.randrange(63)) for _ in range(rng.randint(3, 8))),
             "choices": [" ".join(str(rng.randrange(63)) for _ in range(rng.randint(1, 3))) for _ in range(3)],
             "gold": rng.randrange(3)} for _ in range(8)]
    os.makedirs(directory, exist_ok=True)
    data = os.path.join(directory, "examples.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(doc) + "\n" for doc in docs)
    for name, spec in TASKS.items():
        with open(os.path.join(directory, f"{name}.yaml"), "w") as f:
            json.dump({"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": data}},
                       "test_split": "test", **spec}, f)


def per_example(results: dict, task: str) -> list:
    return [sample["filtered_resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_lm_eval_harness_through_the_server_equals_the_hf_model_on_the_converted_checkpoint(served, tmp_path,
                                                                                            monkeypatch, capsys):
    from megatron_like.inference.harness import run_harness

    root, port = served
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    tasks = str(tmp_path / "tasks")
    write_tasks(tasks)
    output = str(tmp_path / "served.json")
    # The documented command, in this process (the harness's imports take seconds; the HF run below shares them).
    evaluate = runpy.run_path(str(ROOT / "tools" / "evaluate.py"))
    evaluate["main"](["--harness-url", f"http://127.0.0.1:{port}", "--harness-tasks", ",".join(TASKS),
                      "--harness-include-path", tasks, "--harness-max-length", str(POSITIONS), "--harness-output",
                      output])
    table = capsys.readouterr().out
    assert "tiny_choice" in table and "acc" in table  # the harness's table
    with open(output) as f:
        ours = json.load(f)

    hf_dir = str(tmp_path / "hf")
    run_script("tools/convert_hf.py", "to-hf", "--load", f"{root}/ckpt", "--save", hf_dir, timeout=120)
    with open(f"{root}/tokenizer/tokenizer_config.json") as f:
        tokenizer_config = json.load(f)
    with open(os.path.join(hf_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f)
    theirs = run_harness("hf", {"pretrained": hf_dir, "dtype": "float32", "device": "cpu", "max_length": POSITIONS,
                                "batch_size": 1}, list(TASKS), tasks)

    for task in ("tiny_choice", "tiny_rolling"):
        a, b = per_example(ours, task), per_example(theirs, task)
        flat = lambda rows: [float(x[0]) if isinstance(x, list | tuple) else float(x) for row in rows for x in row]  # noqa: E731
        assert len(a) == len(b) == 8
        assert flat(a) == pytest.approx(flat(b), abs=1e-4), task
    assert per_example(ours, "tiny_generate") == per_example(theirs, "tiny_generate")
    acc = ours["results"]["tiny_choice"]["acc,none"]
    assert acc == theirs["results"]["tiny_choice"]["acc,none"]
