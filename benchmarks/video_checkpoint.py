"""Video regression: what per-frame activation checkpointing saves in memory and costs in time.

    python benchmarks/video_checkpoint.py [--batch 32 --frames 8 16 --repeats 5 --threads 1]

One forward + backward of the ``video-motion`` model (``finetune/tasks/video.py``, recipe sizes) on generated clips,
with ``checkpoint_frames`` off (the baseline: all frames encoded at once, every activation kept) and on (each frame
encoded under ``torch.utils.checkpoint``, recomputed in backward). Memory is counted by ``live_bytes.LiveBytes``.
Prints a markdown table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.live_bytes import best_seconds, machine, measure, training_step  # noqa: E402
from finetune.tasks.video import DataConfig, ModelConfig, VideoRegressor, make_clips  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--frames", type=int, nargs="+", default=[8, 16])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier times on a shared machine)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    rows = []
    for frames in args.frames:
        clips = make_clips(DataConfig(clips=args.batch, frames=frames))
        batch = {k: torch.stack([c[k] for c in clips]) for k in ("frames", "scalars", "speed")}
        for on in (False, True):
            torch.manual_seed(0)
            model = VideoRegressor(ModelConfig(checkpoint_frames=on), frames)

            step = training_step(model, batch)
            step()  # warm-up
            mem = measure(step)
            rows.append({"frames": frames, "checkpoint_frames": on, "kept_mb": mem["kept"] / 2**20,
                         "peak_mb": mem["peak"] / 2**20, "seconds": best_seconds(step, args.repeats)})

    print(f"Video regression, batch {args.batch} clips of 32×32 frames, recipe model; {machine()}; "
          f"{time.strftime('%Y-%m-%d')}\n")
    print("| frames | checkpoint_frames | kept for backward (MB) | peak in step (MB) | memory saved "
          f"| step time, best of {args.repeats} (s) | time spent |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        b = next(x for x in rows if x["frames"] == r["frames"] and not x["checkpoint_frames"])
        saved, spent = ((f"{1 - r['peak_mb'] / b['peak_mb']:.0%} of peak", f"{r['seconds'] / b['seconds'] - 1:+.0%}")
                        if r is not b else ("baseline", "baseline"))
        print(f"| {r['frames']} | {'on' if r['checkpoint_frames'] else 'off'} | {r['kept_mb']:.1f} | "
              f"{r['peak_mb']:.1f} | {saved} | {r['seconds']:.3f} | {spent} |")
    summary = {"benchmark": "video_checkpoint", "batch": args.batch, "threads": args.threads, "rows": rows}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
