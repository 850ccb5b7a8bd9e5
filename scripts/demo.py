"""Demo: serve a tiny Llama through the Transformers modeling backend and ask it once.

Builds the tiny checkpoint (random weights, word-level tokenizer; no network), starts
vLLM's OpenAI server on 127.0.0.1 with `--model-impl transformers`, sends one completion
with the `openai` client, prints the prompt and the completion, then what the backend
did, read from its own log lines (`Attention: ...`, `Fused: ...`), and stops the server.
Every wait is bounded and the server is always stopped.

Run it with `bash scripts/demo.sh` (which sets up the environment first).
"""

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "models" / "transformers"))
import tiny  # noqa: E402

ATTENTION = re.compile(
    r"Attention:\s*(?P<module>\S+)\s*\((?P<cls>[^)]*)\)\s*->\s*(?P<rest>.*)"
)
"""`Attention: <module> (<class>) -> <attr> [<layer class>] (layer i, scale s, ...)`."""
NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
DETAIL = {
    "layer": re.compile(r"\blayer\s*[=:]?\s*(\d+)"),
    "scale": re.compile(rf"\bscale\s*[=:]?\s*({NUMBER})"),
    "sliding window": re.compile(r"\bsliding[ _]window\s*[=:]?\s*(\w+)"),
    "soft-cap": re.compile(rf"\bsoft[-_ ]?cap\s*[=:]?\s*({NUMBER}|None)"),
}
FUSED = re.compile(r"\bFused:\s*(?P<what>.*\S)")
PREFIX = re.compile(r"^\((?:\w|[- ])+ pid=\d+\)\s*")  # "(Worker pid=123) " and the like


def backend_activity(log: str) -> tuple[list[dict], list[str], list[str]]:
    """(attention layers, fusions, other backend lines) from the server's output.

    Tolerant: lines may carry any logging prefix; details in the attention line are
    picked up by name when present; each module is reported once (TP ranks repeat)."""
    attention: dict[str, dict] = {}
    fused: dict[str, None] = {}
    notes: dict[str, None] = {}
    for raw in log.splitlines():
        line = PREFIX.sub("", raw).strip()
        if m := ATTENTION.search(line):
            rest = m.group("rest")
            target = rest.split("(", 1)[0].strip() or "?"
            entry = {
                "module": m.group("module"),
                "class": m.group("cls"),
                "attr": target,
            }
            for key, pattern in DETAIL.items():
                if d := pattern.search(rest):
                    entry[key] = d.group(1)
            attention.setdefault(entry["module"], entry)
        elif m := FUSED.search(line):
            fused.setdefault(m.group("what"), None)
        elif "Transformers modeling backend" in line or "Fusion report" in line:
            text = line.split("] ", 1)[-1]
            notes.setdefault(text, None)
    return list(attention.values()), list(fused), list(notes)


def layer_key(entry: dict) -> tuple:
    layer = entry.get("layer")
    return (int(layer) if layer and layer.isdigit() else 1 << 30, entry["module"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default=tiny.PROMPTS[0])
    parser.add_argument("--max-tokens", type=int, default=tiny.MAX_TOKENS)
    parser.add_argument("--ready-timeout", type=float, default=300)
    parser.add_argument(
        "--show-log", action="store_true", help="print the server's whole output"
    )
    args = parser.parse_args()

    import openai

    print("Building the tiny Llama checkpoint ...", flush=True)
    path = tiny.build("llama")
    print(f"  {path}")

    log_dir = Path(tempfile.mkdtemp(prefix="demo-server-"))
    print(
        "Starting the OpenAI server with --model-impl transformers on 127.0.0.1 ...",
        flush=True,
    )
    print(
        "  "
        + " ".join(tiny.server_command(path, 0)[1:]).replace(
            "--port 0", "--port <free>"
        )
    )
    start = time.monotonic()
    try:
        with tiny.serve(
            path,
            model_impl="transformers",
            ready_timeout=args.ready_timeout,
            log_dir=log_dir,
        ) as server:
            print(
                f"  ready in {time.monotonic() - start:.0f} s at {server.base_url}",
                flush=True,
            )
            client = openai.OpenAI(
                base_url=server.base_url, api_key="EMPTY", timeout=120, max_retries=0
            )
            response = client.completions.create(
                model=server.model,
                prompt=args.prompt,
                max_tokens=args.max_tokens,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            log = server.log()
    except Exception as e:  # the server was stopped by `serve`
        print(f"\nDemo failed: {e}", file=sys.stderr)
        print(f"Server output: {log_dir / 'server.log'}", file=sys.stderr)
        return 1
    print("Server stopped.")

    text = response.choices[0].text
    print("\n=== Completion ===")
    print(f"prompt:     {args.prompt!r}")
    print(f"completion: {text!r}")
    (want,) = tiny.reference(path, [args.prompt], args.max_tokens)
    same = "yes" if text == want.text else f"NO (Transformers: {want.text!r})"
    print(f"equals Transformers' greedy generate: {same}")

    attention, fused, notes = backend_activity(log)
    print("\n=== What the backend did ===")
    for note in notes:
        print(note)
    if attention:
        print(f"vLLM attention attached to {len(attention)} modules:")
        for entry in sorted(attention, key=layer_key):
            extras = ", ".join(
                f"{key} {entry[key]}"
                for key in ("sliding window", "soft-cap")
                if entry.get(key) not in (None, "None")
            )
            print(
                f"  layer {entry.get('layer', '?'):>2}  {entry['module']} ({entry['class']}) "
                f"-> {entry['attr']}  scale {entry.get('scale', '?')}"
                + (f"  [{extras}]" if extras else "")
            )
    else:
        print("no `Attention:` lines in the server's output (see --show-log)")
    if fused:
        print(f"Fusions ({len(fused)}):")
        for line in fused:
            print(f"  {line}")
    else:
        print("no `Fused:` lines in the server's output")
    if args.show_log:
        print("\n=== Server output ===")
        print(log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
