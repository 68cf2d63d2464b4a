#!/usr/bin/env python3
"""transformers as a speed peer on the GPU: prefill and batch-1 decode tok/s of one checkpoint.

Loads the checkpoint in bf16 on cuda:0 with sdpa attention (eager where the family has no sdpa
path) and measures, with CUDA synchronised around each timed region:
  prefill  one forward of a `--prompt`-token random prompt, no cache kept (median of --repeat)
  decode   `--decode` greedy tokens after a `--decode-after`-token prompt through generate()
           with its cache, minus that prompt's prefill (median of --repeat)
and prints one line per measurement as `turbospark bench` does, so both sit side by side in a
benchmark log. Run on the device machine:

    python3 bench/transformers_bench.py --model /tmp/qwen4-exp-random --prompt 2048 --decode 64
"""
import argparse
import statistics
import sys
import time

import torch
import transformers


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--decode-after", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("transformers_bench: no CUDA device")
    t_load, model = timed(lambda: load(a.model))
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, vocab, (1, a.prompt), generator=gen).cuda()
    short = torch.randint(4, vocab, (1, a.decode_after), generator=gen).cuda()
    print(f"transformers {transformers.__version__} torch {torch.__version__} on {torch.cuda.get_device_name(0)}; "
          f"{a.model} loaded in {t_load:.1f} s ({type(model).__name__}, bf16, {model.config._attn_implementation})")

    with torch.no_grad():
        model(input_ids=prompt[:, :16], use_cache=False)  # warm-up
        pre = [timed(lambda: model(input_ids=prompt, use_cache=False))[0] for _ in range(a.repeat)]
        p = statistics.median(pre)
        print(f"prefill {a.prompt} tokens: {a.prompt / p:.1f} tok/s ({p * 1e3:.1f} ms, median of {a.repeat})")

        def gen_n(n):
            return model.generate(input_ids=short, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)

        gen_n(2)  # warm-up
        dec = []
        for _ in range(a.repeat):
            t_one, _ = timed(lambda: gen_n(1))  # the prompt's prefill and the first token
            t_all, _ = timed(lambda: gen_n(a.decode + 1))
            dec.append((t_all - t_one) / a.decode)
        d = statistics.median(dec)
        print(f"decode {a.decode} tokens after {a.decode_after}: {1 / d:.1f} tok/s ({d * 1e3:.2f} ms/token, "
              f"median of {a.repeat})")


def load(path):
    kw = dict(dtype=torch.bfloat16, device_map="cuda:0")
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", **kw).eval()
    except (ValueError, NotImplementedError):
        return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **kw).eval()


if __name__ == "__main__":
    main()
