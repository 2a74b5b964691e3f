"""lm-evaluation-harness against ``kvpaging serve``: a log-likelihood task through the OpenAI completions API.

Evaluation harnesses score a model by asking the server for the log-probability of each answer after its
question: lm-evaluation-harness's ``local-completions`` model sends the question and one answer as token ids with
``echo`` and ``logprobs`` and ``max_tokens=1``, and reads the prompt's log-probabilities back (kvpaging's
``prompt_logprobs``). This script runs such a task twice on the trained model (SmolLM2-135M-Instruct), in float32:

1. ``--model local-completions`` against ``kvpaging serve smollm2`` (started here on a free port of 127.0.0.1);
2. ``--model hf``: transformers' own forward pass in lm-evaluation-harness's process, the reference;

and compares them document by document: the accuracy, every answer's log-likelihood (the largest difference),
and whether each was the greedy continuation. The task is written here, with no download: 30 multiple-choice
questions of general knowledge (``QUESTIONS`` below), four answers each, scored by ``acc``.

lm-evaluation-harness runs in the peers environment (``make peers`` installs it beside vLLM), the server in
kvpaging's::

    python benchmarks/lm_eval_local.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from serving import ROOT, launch, transformers_model_folder

# (question, answers, index of the right one): written for this script
QUESTIONS = [
    ("The capital of France is", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("The capital of Japan is", ["Seoul", "Tokyo", "Beijing", "Bangkok"], 1),
    ("The largest planet in the solar system is", ["Mars", "Venus", "Jupiter", "Mercury"], 2),
    ("Water freezes at a temperature of zero degrees", ["Fahrenheit", "Kelvin", "Rankine", "Celsius"], 3),
    ("The chemical symbol for gold is", ["Au", "Ag", "Fe", "Pb"], 0),
    ("A week has", ["five days", "seven days", "ten days", "twelve days"], 1),
    ("The opposite of hot is", ["warm", "loud", "cold", "bright"], 2),
    ("The animal known as the king of the jungle is the", ["mouse", "rabbit", "sheep", "lion"], 3),
    ("The sun rises in the", ["east", "west", "north", "south"], 0),
    ("Bees make", ["milk", "honey", "silk", "wool"], 1),
    ("The first month of the year is", ["March", "June", "January", "October"], 2),
    ("Two plus two equals", ["three", "five", "six", "four"], 3),
    ("The Pacific is an", ["ocean", "island", "mountain", "desert"], 0),
    ("Shakespeare wrote", ["The Odyssey", "Hamlet", "Don Quixote", "Faust"], 1),
    ("The color of a clear daytime sky is", ["green", "red", "blue", "purple"], 2),
    ("A baby cat is called a", ["puppy", "calf", "foal", "kitten"], 3),
    ("The Earth orbits the", ["Sun", "Moon", "Mars", "comet"], 0),
    ("Ice is the solid form of", ["salt", "water", "sand", "air"], 1),
    ("The tallest animal in the world is the", ["elephant", "horse", "giraffe", "camel"], 2),
    ("The main language spoken in Brazil is", ["Spanish", "French", "English", "Portuguese"], 3),
    ("A triangle has", ["three sides", "four sides", "five sides", "six sides"], 0),
    ("The organ that pumps blood through the body is the", ["lung", "heart", "liver", "kidney"], 1),
    ("The currency of the United States is the", ["euro", "yen", "dollar", "pound"], 2),
    ("Paper is mostly made from", ["glass", "stone", "metal", "wood"], 3),
    ("The Great Wall is in", ["China", "Egypt", "Peru", "Italy"], 0),
    ("Plants take in carbon dioxide and give off", ["nitrogen", "oxygen", "helium", "smoke"], 1),
    ("The number of continents on Earth is", ["three", "five", "seven", "ten"], 2),
    ("A rainbow appears when sunlight passes through", ["smoke", "dust", "wind", "raindrops"], 3),
    ("The author of the theory of relativity was", ["Einstein", "Newton", "Darwin", "Pasteur"], 0),
    ("The freezing point of water in Fahrenheit is", ["0 degrees", "32 degrees", "100 degrees", "212 degrees"], 1),
]

TASK = """task: kvpaging_general_knowledge
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(folder: str) -> None:
    data = os.path.join(folder, "general_knowledge.jsonl")
    with open(data, "w") as f:
        for question, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    with open(os.path.join(folder, "kvpaging_general_knowledge.yaml"), "w") as f:
        f.write(TASK.format(data=data))


def run_lm_eval(python: str, model: str, model_args: str, tasks: str, out: str) -> dict:
    """One lm_eval run; returns its per-document samples, by document id."""
    command = [python, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks",
               "kvpaging_general_knowledge", "--include_path", tasks, "--output_path", out, "--log_samples",
               "--batch_size", "1", "--device", "cpu"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    os.makedirs(out, exist_ok=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=out)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval --model {model} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    samples = {}
    for root, _, files in os.walk(out):
        for name in files:
            if name.startswith("samples_") and name.endswith(".jsonl"):
                with open(os.path.join(root, name)) as f:
                    for line in f:
                        doc = json.loads(line)
                        samples[doc["doc_id"]] = doc
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers-python", default=os.path.join(ROOT, ".venv-peers", "bin", "python"))
    args = ap.parse_args()
    if not os.path.exists(args.peers_python):
        raise SystemExit(f"lm-evaluation-harness runs in the peers environment: run `make peers` (no {args.peers_python})")
    with tempfile.TemporaryDirectory(prefix="kvpaging-lm-eval-") as work:
        tasks = os.path.join(work, "tasks")
        os.makedirs(tasks)
        write_task(tasks)
        folder = transformers_model_folder("smollm2", os.path.join(work, "model"))
        server, url, name = launch("smollm2 --dtype float32 --max-model-len 512", None)
        try:
            served = run_lm_eval(args.peers_python, "local-completions",
                                 f"model={name},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                                 f"tokenizer={folder},num_concurrent=1,max_retries=1", tasks, os.path.join(work, "a"))
        finally:
            server.terminate()
            server.wait(60)
        own = run_lm_eval(args.peers_python, "hf", f"pretrained={folder},dtype=float32", tasks,
                          os.path.join(work, "b"))
    acc = {k: sum(d["acc"] for d in s.values()) / len(s) for k, s in (("served", served), ("hf", own))}
    gaps, same_greedy, same_choice = [], 0, 0
    for doc_id, doc in own.items():
        mine = served[doc_id]
        ours = [r[0] for r in mine["filtered_resps"]]
        theirs = [r[0] for r in doc["filtered_resps"]]
        gaps += [abs(float(a) - float(b)) for a, b in zip(ours, theirs)]
        same_choice += max(range(len(ours)), key=ours.__getitem__) == max(range(len(theirs)), key=theirs.__getitem__)
        same_greedy += [r[1] for r in mine["filtered_resps"]] == [r[1] for r in doc["filtered_resps"]]
    print(f"lm-evaluation-harness, task kvpaging_general_knowledge ({len(own)} questions, 4 answers each), "
          f"SmolLM2-135M-Instruct in float32, {sys.platform}")
    print(f"  acc through kvpaging serve (local-completions, echo + logprobs): {acc['served']:.4f}")
    print(f"  acc with transformers' own forward (hf):                         {acc['hf']:.4f}")
    print(f"  the same answer chosen: {same_choice} of {len(own)} questions; the same is_greedy flags: "
          f"{same_greedy} of {len(own)}")
    print(f"  answer log-likelihoods: largest difference {max(gaps):.2e} over {len(gaps)} answers")


if __name__ == "__main__":
    main()
