"""Render a decoding trace as a picture of the order in which ReFusion filled the answer.

    python -m refusion_mlx.chat --trace trace.json         # chat, then Ctrl-D
    python examples/render_trace.py trace.json -o trace.png [--turn N]

Top: a timeline, one row per decoding step, one column per answer position;
the slots committed at that step are coloured (blue: accepted by global
verification, orange: parallel infill), those committed earlier grey.
Bottom: the answer's tokens in reading order, each coloured by the step that
committed it (light = early, dark = late), with the step number on top:
where colours are not monotone, slots finished out of order. Needs Pillow
(``pip install pillow``; it is in the ``test`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Tuple

from PIL import Image, ImageDraw, ImageFont

PHASE_COLOURS = {"verify": (52, 120, 198), "infill": (236, 134, 40)}
EARLIER = (206, 206, 206)
DROPPED = (238, 238, 238)
GRADIENT = [(253, 231, 37), (94, 201, 98), (33, 145, 140), (59, 82, 139), (68, 1, 84)]  # viridis, reversed
INK = (20, 20, 20)


def font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: a fixed bitmap font
        return ImageFont.load_default()


def gradient(t: float) -> Tuple[int, int, int]:
    """A colour from light (t=0) to dark (t=1)."""
    t = min(max(t, 0.0), 1.0) * (len(GRADIENT) - 1)
    i = min(int(t), len(GRADIENT) - 2)
    a, b, f = GRADIENT[i], GRADIENT[i + 1], t - i
    return tuple(round(a[k] + (b[k] - a[k]) * f) for k in range(3))


def load_turn(path: str, turn: int = 0) -> List[dict]:
    """The steps of one turn (0: the last one) from a ``--trace`` file."""
    with open(path) as f:
        steps = json.load(f)
    if not isinstance(steps, list) or not steps:
        raise ValueError(f"{path} holds no steps")
    turns = sorted({s["turn"] for s in steps})
    chosen = turns[-1] if turn == 0 else turn
    if chosen not in turns:
        raise ValueError(f"{path} has turns {turns}, not {turn}")
    return [s for s in steps if s["turn"] == chosen]


def answer_cells(steps: List[dict]) -> Tuple[Dict[int, Tuple[int, str, str]], int]:
    """offset -> (step, phase, text) for every committed token, and the first EOS offset (or -1)."""
    start = steps[0]["response_start"]
    cells, eos = {}, -1
    for s in steps:
        for p, t, piece in zip(s["positions"], s["tokens"], s["pieces"]):
            cells[p - start] = (s["step"], s["phase"], piece)
            if t == s.get("eos_id") and (eos < 0 or p - start < eos):
                eos = p - start
    return cells, eos


def render(steps: List[dict], out: str, width: int = 1200) -> Tuple[int, int]:
    """Draw the timeline and the answer map; return the image size."""
    cells, eos = answer_cells(steps)
    n_pos = max(cells) + 1
    n_steps = len(steps)
    pad, title_h = 16, 52
    cw = max(2, min(24, (width - 2 * pad) // n_pos))
    rh = max(3, min(18, 420 // n_steps))
    timeline_h = rh * n_steps

    # the answer map: tokens wrapped into rows of boxes sized to their text
    f_tok, f_small, f_title = font(15), font(10), font(17)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    boxes, x, y, row_h = [], pad, 0, 40
    for offset in range(n_pos):
        step, phase, piece = cells.get(offset, (-1, "", "?"))
        label = piece.replace("\n", "\\n")  # the default font has no glyphs for symbols like U+21B5
        if not label.strip():
            label = label.replace(" ", "\u00b7") or "?"  # a space token shows as a middle dot
        if offset == eos:
            label = "EOS"
        w = max(22, int(probe.textlength(label, font=f_tok)) + 10)
        if x + w > width - pad:
            x, y = pad, y + row_h + 4
        boxes.append((x, y, w, offset, step, label))
        x += w + 2
    map_h = y + row_h

    legend_h = 28
    height = title_h + timeline_h + 24 + map_h + legend_h + 2 * pad
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    answer_len = eos + 1 if eos >= 0 else n_pos
    d.text((pad, pad), f"ReFusion decoding order: {answer_len} answer tokens in {n_steps} steps "
                       f"(turn {steps[0]['turn']})", fill=INK, font=f_title)
    d.text((pad, pad + 22), "timeline: one row per step, one column per answer position; "
                            "blue = verified, orange = infill, grey = committed earlier",
           fill=(90, 90, 90), font=f_small)

    top = title_h
    committed = set()
    for i, s in enumerate(steps):
        now = {p - s["response_start"] for p in s["positions"]}
        for o in committed:
            d.rectangle([pad + o * cw, top + i * rh, pad + (o + 1) * cw - 1, top + (i + 1) * rh - 2], fill=EARLIER)
        for o in now:
            d.rectangle([pad + o * cw, top + i * rh, pad + (o + 1) * cw - 1, top + (i + 1) * rh - 2],
                        fill=PHASE_COLOURS.get(s["phase"], (120, 120, 120)))
        committed |= now
    d.rectangle([pad - 1, top - 1, pad + n_pos * cw, top + timeline_h], outline=(150, 150, 150))

    top += timeline_h + 24
    d.text((pad, top - 18), "answer in reading order, coloured by the step that committed each token "
                            "(light = early, dark = late)", fill=(90, 90, 90), font=f_small)
    for bx, by, w, offset, step, label in boxes:
        dropped = eos >= 0 and offset > eos
        colour = DROPPED if dropped or step < 0 else gradient(step / max(n_steps - 1, 1))
        dark = not dropped and step >= 0 and step / max(n_steps - 1, 1) > 0.45
        d.rectangle([bx, top + by, bx + w, top + by + row_h], fill=colour, outline="white")
        d.text((bx + 3, top + by + 1), str(step + 1) if step >= 0 else "", fill=(235, 235, 235) if dark else (60, 60, 60),
               font=f_small)
        d.text((bx + 5, top + by + 16), label, fill=(255, 255, 255) if dark else (150, 150, 150) if dropped else INK,
               font=f_tok)

    ly = top + map_h + 10
    for i in range(n_steps):
        x0 = pad + 60 + i * min(30, (width - 200) // n_steps)
        d.rectangle([x0, ly, x0 + min(30, (width - 200) // n_steps) - 1, ly + 12],
                    fill=gradient(i / max(n_steps - 1, 1)))
    d.text((pad, ly), "step 1", fill=INK, font=f_small)
    d.text((pad + 64 + n_steps * min(30, (width - 200) // n_steps), ly), f"step {n_steps}", fill=INK, font=f_small)
    img.save(out)
    return img.size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a JSON trace written by python -m refusion_mlx.chat --trace")
    parser.add_argument("-o", "--output", default="trace.png", help="PNG to write (default trace.png)")
    parser.add_argument("--turn", type=int, default=0, help="which turn (default: the last)")
    parser.add_argument("--width", type=int, default=1200, help="image width in pixels")
    args = parser.parse_args()
    try:
        steps = load_turn(args.trace, args.turn)
        size = render(steps, args.output, args.width)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} ({size[0]}x{size[1]}, {len(steps)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
