"""Where one robot's observation-to-action time goes through inferd: the client's round trip against the
gateway's own frame-in to chunk-out (`server_timing.total_ms`), the replica's queue wait and forward pass;
what is left is the hop (the gateway's and the replica's checks, the HTTP round trip, the batcher's thread).

    python benchmarks/policy_hop.py --out benchmarks/results/policy_hop.json
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.policy import inferd_server, machine  # noqa: E402
from inferd.policy.sim import ReacherTask  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--observations", type=int, default=300)
    p.add_argument("--backend", default="local", help="local: a replica process; in_process: the gateway's")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from openpi_client.websocket_client_policy import WebsocketClientPolicy
    rows = []
    with tempfile.TemporaryDirectory() as tmp, inferd_server(Path(tmp), args.backend) as (url, key):
        client = WebsocketClientPolicy(url, api_key=key)
        obs = ReacherTask(0).observation()
        for _ in range(args.observations + 50):
            started = time.perf_counter()
            t = client.infer(obs)["server_timing"]
            rows.append(((time.perf_counter() - started) * 1000, t["total_ms"], t["queue_ms"], t["infer_ms"]))
        client._ws.close()
    rows = rows[50:]  # warm-up
    med = [statistics.median(r[i] for r in rows) for i in range(4)]
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "backend": args.backend,
              "observations": len(rows),
              "median_ms": {"client_round_trip": round(med[0], 3), "gateway_frame_in_to_chunk_out": round(med[1], 3),
                            "replica_queue": round(med[2], 3), "forward_pass": round(med[3], 3),
                            "hop": round(med[1] - med[2] - med[3], 3)}}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
