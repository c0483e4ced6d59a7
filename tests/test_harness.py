"""The lm-evaluation-harness model (``mode.eval.harness``, registered as ``mode``) answers a
local two-task file, offline: one multiple-choice (loglikelihood) and one generate_until
task, with the numbers of this library's own forward."""

from __future__ import annotations

import json

import pytest
import torch

from mode.config import load_config
from mode.train import train
from tests.tiny import TINY

pytest.importorskip("lm_eval")

CHOICE = [
    {"question": "To be or not to", "choices": ["be", "eat", "run"], "label": 0},
    {"question": "ROMEO: What light", "choices": ["through", "is", "never"], "label": 0},
    {"question": "Now is the winter of our", "choices": ["discontent", "summer"], "label": 0},
]
GENERATE = [{"prompt": "KING:", "answer": " the"}, {"prompt": "Shall I compare", "answer": " thee"}]
TASKS = """
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
CHOICE_TASK = """output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""
GENERATE_TASK = """output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = load_config("mod", [*TINY, "model.mod.causal=predictor", "train.steps=2", f"train.out_dir={out}"])
    train(cfg)
    return out / "ckpt.pt"


def write_tasks(root) -> None:
    for name, rows, body in (("mode_choice", CHOICE, CHOICE_TASK), ("mode_generate", GENERATE, GENERATE_TASK)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{name}.yaml").write_text(TASKS.format(name=name, data=data) + body.format())


def test_the_harness_model_answers_a_local_task_file_with_our_numbers(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import lm_eval
    from lm_eval.tasks import TaskManager

    from mode.eval.harness import ModeLM

    write_tasks(tmp_path)
    results = lm_eval.simple_evaluate(
        model="mode",
        model_args=f"pretrained={checkpoint}",
        tasks=["mode_choice", "mode_generate"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    ours = ModeLM(str(checkpoint))
    assert ours.routing == "causal"  # the MoD block decides per token: no look at later tokens
    # multiple choice: each choice's log-likelihood after the target delimiter " ", and accuracy
    samples = sorted(results["samples"]["mode_choice"], key=lambda s: s["doc_id"])
    correct = []
    for sample, doc in zip(samples, CHOICE, strict=True):
        scores = [ours.loglikelihood_one(doc["question"], " " + c) for c in doc["choices"]]
        got = [resp[0] for resp in sample["resps"]]
        assert [g[0] for g in got] == pytest.approx([s[0] for s in scores], abs=1e-4)
        correct.append(max(range(len(scores)), key=lambda i: scores[i][0]) == doc["label"])
    assert results["results"]["mode_choice"]["acc,none"] == pytest.approx(sum(correct) / len(correct))
    # generate_until: greedy tokens of our own generate, cut at the first stop string
    samples = sorted(results["samples"]["mode_generate"], key=lambda s: s["doc_id"])
    for sample, doc in zip(samples, GENERATE, strict=True):
        prompt = torch.tensor(ours.tok.encode(doc["prompt"]))[None]
        text = ours.tok.decode(ours.model.generate(prompt, 6, temperature=0.0)[0, prompt.shape[1] :].tolist())
        assert sample["resps"][0][0] == text.split("\n")[0]


def test_rolling_loglikelihood_scores_every_token_once(checkpoint):
    from mode.eval.harness import ModeLM

    ours = ModeLM(str(checkpoint), routing="topk")
    text = "O Romeo, Romeo! wherefore art thou Romeo? " * 3  # longer than one 32-token window
    ids = ours.tok.encode(text)
    want = 0.0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, 32):  # the byte tokenizer has no end-of-text id
            window = torch.tensor(ids[start : start + 33])[None]
            logits, _ = ours.model(window[:, :-1], routing="topk")
            want += torch.log_softmax(logits[0], -1).gather(1, window[0, 1:, None]).sum().item()

    class Request:
        args = (text,)

    assert ours.loglikelihood_rolling([Request()]) == [pytest.approx(want, abs=1e-4)]


def test_loglikelihood_scores_the_continuation_by_the_models_forward(checkpoint):
    """lm-eval's loglikelihood requests: log p(continuation | context) summed from the
    model's own logits at the positions that predict each continuation id."""
    from mode.eval.harness import ModeLM

    ours = ModeLM(str(checkpoint), routing="topk")
    context, continuation = "ROMEO: What light", " through yonder"
    ctx, cont = ours.tok.encode(context), ours.tok.encode(continuation)
    ids = torch.tensor(ctx + cont)[None]
    with torch.no_grad():
        logits, _ = ours.model(ids[:, :-1], routing="topk")
    logprobs = torch.log_softmax(logits[0].float(), -1)
    want = sum(logprobs[len(ctx) - 1 + i, c].item() for i, c in enumerate(cont))
    greedy = all(logprobs[len(ctx) - 1 + i].argmax().item() == c for i, c in enumerate(cont))

    class Request:
        args = (context, continuation)

    [(score, is_greedy)] = ours.loglikelihood([Request()])
    assert score == pytest.approx(want, abs=1e-4) and is_greedy == greedy


def test_the_mode_lm_eval_command_runs_lm_evals_own_cli_on_the_cpu(checkpoint, tmp_path):
    """``mode-lm-eval`` (lm-eval's command line with the model registered): its default
    ``--model`` is ours, lm-eval's default device ``cuda:0`` becomes the CPU here (said), and
    the accuracy it writes is the one our forward gives."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from mode.eval.harness import ModeLM

    write_tasks(tmp_path)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    command = [str(Path(sys.executable).parent / "mode-lm-eval"), "--model_args", f"pretrained={checkpoint}"]
    command += ["--tasks", "mode_choice", "--include_path", str(tmp_path), "--output_path", str(tmp_path / "out")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    if not torch.cuda.is_available():
        assert "'cuda:0' but this torch has no CUDA device: using cpu" in done.stderr
    [written] = list((tmp_path / "out").rglob("results*.json"))
    acc = json.loads(written.read_text())["results"]["mode_choice"]["acc,none"]
    ours = ModeLM(str(checkpoint))
    right = [
        max(range(len(d["choices"])), key=lambda i: ours.loglikelihood_one(d["question"], " " + d["choices"][i])[0])
        == d["label"]
        for d in CHOICE
    ]
    assert acc == pytest.approx(sum(right) / len(right))


def test_mode_lm_eval_names_a_missing_checkpoint_in_one_line(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    write_tasks(tmp_path)
    command = [str(Path(sys.executable).parent / "mode-lm-eval"), "--model_args", f"pretrained={tmp_path}/none.pt"]
    command += ["--tasks", "mode_choice", "--include_path", str(tmp_path), "--device", "cpu"]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_DATASETS_OFFLINE": "1"}
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "mode-lm-eval: " in done.stderr and f"{tmp_path}/none.pt\n" in done.stderr
