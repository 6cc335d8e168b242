"""Run vLLM (CPU) on token-id prompts and write greedy tokens + top-k logprobs as JSON.

Runs under the vLLM venv's python (``bash scripts/vllm_venv.sh`` prints it), never ours: it
imports nothing of mmserve. One process serves every job in turn (vLLM's import and start-up
dominate the cost).

    VENV_PY scripts/vllm_oracle.py JOBS.json OUT.json
    JOBS.json: [{"name", "model", "prompts": [[ids]], "max_tokens", "logprobs", "max_model_len", "trust_remote_code",
                 "variants": {label: {SamplingParams field: value}} (optional: more greedy runs, e.g. penalties;
                              "structured_outputs": {...} makes a run that stops at EOS, not ignore_eos)}]
    OUT.json:  {name: [{"tokens": [...], "logprobs": [{token_id: logprob} per step]} per prompt],
                "name/label": the same for each variant, plus "prompt_logprobs": [null, {token_id: [logprob, rank]}
                              per later prompt position] when the variant sets prompt_logprobs}
"""

from __future__ import annotations

import gc
import json
import os
import sys


def main(jobs_path: str, out_path: str) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    results = {}
    for job in json.loads(open(jobs_path).read()):
        llm = LLM(model=job["model"], dtype="float32", max_model_len=job.get("max_model_len", 512),
                  enforce_eager=True, seed=0, max_num_seqs=8, trust_remote_code=job.get("trust_remote_code", False))
        params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], logprobs=job.get("logprobs", 5),
                                ignore_eos=True)
        runs = {job["name"]: params}
        for label, extra in job.get("variants", {}).items():
            if "logit_bias" in extra:
                extra = {**extra, "logit_bias": {int(k): v for k, v in extra["logit_bias"].items()}}
            ignore_eos = True
            if "structured_outputs" in extra:
                extra = {**extra, "structured_outputs": StructuredOutputsParams(**extra["structured_outputs"])}
                ignore_eos = False
            extra.setdefault("max_tokens", job["max_tokens"])
            runs[f"{job['name']}/{label}"] = SamplingParams(temperature=0.0, logprobs=job.get("logprobs", 5),
                                                           ignore_eos=ignore_eos, **extra)
        for key, sp in runs.items():
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], sp, use_tqdm=False)
            results[key] = [
                {"tokens": list(o.outputs[0].token_ids),
                 "logprobs": [{str(t): float(lp.logprob) for t, lp in step.items()} for step in o.outputs[0].logprobs],
                 **({"prompt_logprobs": [None if pos is None else {str(t): [float(lp.logprob), lp.rank]
                                                                   for t, lp in pos.items()}
                                         for pos in o.prompt_logprobs]} if sp.prompt_logprobs is not None else {})}
                for o in outs
            ]
        del llm
        gc.collect()
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
