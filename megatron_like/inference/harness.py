"""EleutherAI's lm-evaluation-harness against the OpenAI-compatible server (``tools/text_generation_server.py``).

The harness's ``local-completions`` model sends ``/v1/completions`` requests: log-likelihood tasks (multiple
choice, perplexity) as ``echo`` + ``logprobs`` + ``max_tokens: 1`` of the context and continuation token ids,
generation tasks as greedy completions with ``stop`` strings. It tokenizes with the server's tokenizer through
``/tokenizer_info``, ``/tokenize`` and ``/detokenize`` (vLLM's endpoints), so a checkpoint needs no Hugging Face
tokenizer to be evaluated. Tasks come from the harness's registry or from YAML files in ``include_path`` (a
task over a local ``jsonl`` file downloads nothing; this function sets ``HF_DATASETS_OFFLINE`` and
``HF_HUB_OFFLINE`` so a task that would download fails instead).

    python tools/text_generation_server.py --load ckpt --port 5000 &
    python tools/evaluate.py --harness-url http://127.0.0.1:5000 --harness-tasks my_task \\
        --harness-include-path tasks/ --harness-max-length 1024
"""

from __future__ import annotations

import os


def harness_model_args(base_url: str, max_length: int, model: str = "served", num_concurrent: int = 1,
                       batch_size: int = 1) -> dict:
    """The ``local-completions`` arguments for the server at ``base_url`` (``http://host:port``)."""
    return {"model": model, "base_url": f"{base_url.rstrip('/')}/v1/completions", "tokenizer_backend": "remote",
            "max_length": max_length, "num_concurrent": num_concurrent, "batch_size": batch_size, "max_retries": 1,
            "tokenized_requests": True}


def run_harness(model: str, model_args: dict, tasks: list[str], include_path: str | None = None,
                limit: int | None = None) -> dict:
    """``lm_eval.simple_evaluate`` offline: its results dict (``results``, and ``samples`` per task)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise SystemExit("error: lm-evaluation-harness is not installed: pip install 'lm-eval[api]==0.4.13'") from None
    manager = None
    if include_path:  # indexing the harness's thousands of own tasks takes seconds: only when needed
        manager = TaskManager(include_path=include_path, include_defaults=False)
    if manager is None or any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise SystemExit(f"error: unknown harness task(s) {', '.join(unknown)}"
                         + (f" (none in --harness-include-path {include_path})" if include_path else ""))
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=manager,
                                   limit=limit, log_samples=True, bootstrap_iters=0)


def evaluate_server(base_url: str, tasks: list[str], max_length: int, include_path: str | None = None,
                    limit: int | None = None, num_concurrent: int = 1) -> dict:
    """The harness's results for ``tasks`` through the server at ``base_url``."""
    return run_harness("local-completions", harness_model_args(base_url, max_length, num_concurrent=num_concurrent),
                       tasks, include_path, limit)
