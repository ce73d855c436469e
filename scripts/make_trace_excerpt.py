"""Cut the excerpt of the Mooncake conversation trace that ships with the workbench.

The first N requests, byte-identical lines, so notebooks work outside a checkout that
has ../shared/traces. The full trace stays where it is (not copied into the repo).

    python scripts/make_trace_excerpt.py [--n 400]
"""
import argparse
import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT.parent / "shared" / "traces" / "mooncake_fast25_conversation" / "conversation_trace.jsonl"
DST = ROOT / "workbench" / "data" / "mooncake_conversation_excerpt.jsonl"
NOTE = ROOT / "workbench" / "data" / "mooncake_conversation_excerpt.SOURCE.txt"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=400)
    a = ap.parse_args()
    lines = SRC.read_bytes().split(b"\n")[: a.n]
    data = b"\n".join(lines) + b"\n"
    DST.write_bytes(data)
    NOTE.write_text(
        "Excerpt: the first {n} lines (byte-identical) of the Mooncake FAST'25 'conversation' trace\n"
        "(Kimi production, anonymized), made by scripts/make_trace_excerpt.py.\n"
        "Source: https://github.com/kvcache-ai/Mooncake, FAST25-release/traces/conversation_trace.jsonl\n"
        "  (git blob 5a371794b81d7fc7487ec8a02a2c631bcc7fbdf8; full file sha256\n"
        "  b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df)\n"
        "Licence: Apache-2.0 (the Mooncake repository's LICENSE-APACHE). Cite the Mooncake FAST'25 paper:\n"
        "  Qin et al., \"Mooncake: Trading More Storage for Less Computation\", FAST 2025.\n"
        "Format: JSONL {{timestamp ms, input_length, output_length, hash_ids over 512-token blocks}}.\n"
        "Excerpt sha256: {h}\n".format(n=a.n, h=hashlib.sha256(data).hexdigest()))
    print(f"wrote {DST} ({len(data)} bytes, {a.n} requests)")


if __name__ == "__main__":
    main()
