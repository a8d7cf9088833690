"""Robots in closed loop through a policy server: inferd (`inferd serve`, the gateway's WebSocket route, the
policy replica's batcher) against OpenPI's reference server (`openpi-server` from PyPI, its
WebsocketPolicyServer, run beside with the same policy), both with openpi-client's WebsocketClientPolicy.

Each robot is a thread with its own simulator (inferd.policy.sim.ReacherTask) run at the policy's control
rate: it asks for a chunk (observation stamped with `inferd.timestamp` and a deadline of one control
period), plays the chunk's actions one per control tick, asks again; a missing answer (an error frame) is a
tick with zero torque. Measured per run: observation-to-action latency as the robot sees it (p50, p99,
jitter = p99 - p50), missed deadlines (an answer later than the deadline, or an error frame), task success
rate (against the same policy run in-process on the same episodes), and with --stall one robot's network
stalled for 2 s by a TCP proxy in its path (its observation arrives 2 s old): what that robot is told and
what the others' latency does meanwhile.

    python benchmarks/policy.py --out benchmarks/results/policy.json

Every server starts first and they take turns in each cell (robots, stall, repeat). Each gets one torch thread.
Load generator, servers and simulators share the machine: read ratios.
"""
import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inferd.policy.demo import DEMO_NAME, demo_policy_path  # noqa: E402
from inferd.policy.sim import EPISODE_STEPS, ReacherTask, evaluate  # noqa: E402

STALL_S = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the servers

@contextmanager
def inferd_server(work: Path, backend: str = "local"):
    """`inferd serve` with one deployment, the demo policy (placement.backend: local, a replica process of its
    own, or in_process, in the gateway's process); yields (ws url, key)."""
    port = free_port()
    spec = work / "policy.yaml"
    spec.write_text(f"deployments:\n  - name: {DEMO_NAME}\n    kind: policy\n    model: {{source: default}}\n"
                    f"    runtime: {{num_threads: 1}}\n    placement: {{backend: {backend}}}\n")
    key = "sk-inferd-benchpolicy0000000000000000"
    cmd = [sys.executable, "-m", "inferd.cli", "serve", "--config", str(spec), "--port", str(port),
           "--db", f"sqlite:///{work / 'inferd.db'}", "--spill-path", str(work / "spill.jsonl"), "--api-key", key,
           "--log-level", "warning"]
    with (work / "inferd.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", proc, work / "inferd.log")
        yield f"ws://127.0.0.1:{port}/v1/policies/{DEMO_NAME}/ws", key
    finally:
        proc.terminate()
        proc.wait(30)


@contextmanager
def openpi_server(work: Path):
    port = free_port()
    cmd = [sys.executable, __file__, "--serve-openpi", str(port)]
    with (work / "openpi.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", proc, work / "openpi.log")
        yield f"ws://127.0.0.1:{port}", None
    finally:
        proc.terminate()
        proc.wait(30)


def serve_openpi(port: int) -> None:
    """OpenPI's reference server over the same policy (as its own scripts serve one: infer on the loop)."""
    import torch
    from openpi_client import base_policy
    from openpi_server import WebsocketPolicyServer
    from inferd.policy.model import load_policy
    from inferd.protocol.policy import ObservationSpec, check_observation

    torch.set_num_threads(1)
    files = load_policy(demo_policy_path(), threads=1)
    spec = ObservationSpec.from_dict(files.observation_spec)

    class Policy(base_policy.BasePolicy):
        def infer(self, obs: dict) -> dict:
            return {"actions": files.predict([check_observation(spec, obs).values])[0]}

    WebsocketPolicyServer(Policy(), host="127.0.0.1", port=port, metadata=files.metadata()).serve_forever()


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


# a TCP proxy that can stall one robot's path

class StallProxy:
    """Forwards 127.0.0.1:port to the target; stall(seconds) holds everything the robot sends for that long."""

    def __init__(self, target_port: int):
        self.target_port, self.port = target_port, free_port()
        self._stalled_until = 0.0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait()

    def stall(self, seconds: float) -> None:
        self._stalled_until = time.monotonic() + seconds

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def pipe(reader, writer, upstream: bool):
            try:
                while data := await reader.read(1 << 16):
                    while upstream and time.monotonic() < self._stalled_until:
                        await asyncio.sleep(0.005)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        async def handle(reader, writer):
            r2, w2 = await asyncio.open_connection("127.0.0.1", self.target_port)
            await asyncio.gather(pipe(reader, w2, True), pipe(r2, writer, False))

        async def main():
            await asyncio.start_server(handle, "127.0.0.1", self.port)
            self._ready.set()
            await asyncio.Event().wait()

        self._loop.run_until_complete(main())


# the robots

def robot(url: str, key: str | None, seeds: list[int], deadline_ms: float, out: dict, stall=None) -> None:
    """Closed loop at the control rate over `seeds` episodes; fills out with its measurements."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy
    client = WebsocketClientPolicy(url, api_key=key)
    meta = client.get_server_metadata()
    period = 1.0 / meta["control_hz"]
    task = ReacherTask(seeds[0])
    latencies, stamps, missed, errors, successes, stale_run = [], [], 0, {}, 0, 0
    for episode, seed in enumerate(seeds):
        task.reset(seed)
        tick = time.monotonic()
        while task.steps < EPISODE_STEPS:
            obs = task.observation() | {"inferd.timestamp": time.time(), "inferd.deadline_ms": deadline_ms}
            if stall is not None and episode == len(seeds) // 2 and not stall.get("done"):
                stall["proxy"].stall(STALL_S)
                stall["done"], stall["at"] = True, time.monotonic()
            t0 = time.monotonic()
            try:
                reply = client.infer(obs)
            except RuntimeError as exc:  # an error frame
                code = json.loads(str(exc).split("\n", 1)[1])["error"]["code"]
                errors[code] = errors.get(code, 0) + 1
                missed += 1
                if stall is not None and stall.get("at") and t0 - stall["at"] < 0.1:
                    stall["answer"] = code
                actions = np.zeros((1, 2), np.float32)
            else:
                latency = time.monotonic() - t0
                latencies.append(latency)
                stamps.append(t0)
                late = latency * 1000 > deadline_ms or reply.get("late", False)
                missed += late
                if stall is not None and stall.get("at") and t0 - stall["at"] < 0.1:
                    stall["answer"] = f"actions ({latency * 1000:.0f} ms after the observation)"
                    stale_run += 1
                actions = reply["actions"]
            for action in actions:
                if task.steps >= EPISODE_STEPS:
                    break
                task.step(action)
                tick += period
                time.sleep(max(0.0, tick - time.monotonic()))
            tick = max(tick, time.monotonic())  # a late answer does not make the robot rush to catch up
        successes += task.success()
    client._ws.close()  # openpi-client has no close(); a session left open holds a slot until the idle timeout
    out.update(latencies=latencies, stamps=stamps, missed=missed, errors=errors, successes=successes,
               episodes=len(seeds), seeds=list(seeds), stale_run=stale_run)


def run(url: str, key: str | None, robots: int, episodes: int, deadline_ms: float, stall: bool, target_port,
        expected: dict[int, bool]):
    outs = [{} for _ in range(robots)]
    stall_state = {"proxy": StallProxy(target_port)} if stall else None
    threads = []
    for i in range(robots):
        seeds = [10_000 + i * episodes + e for e in range(episodes)]
        robot_url = url
        if stall and i == 0:
            robot_url = url.replace(f":{target_port}", f":{stall_state['proxy'].port}")
        threads.append(threading.Thread(target=robot, args=(robot_url, key, seeds, deadline_ms, outs[i],
                                                            stall_state if stall and i == 0 else None)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarise(outs, deadline_ms, stall_state, expected)


def summarise(outs: list[dict], deadline_ms: float, stall: dict | None, expected: dict[int, bool]) -> dict:
    """Over the robots whose network was not stalled (the stalled one is reported under "stall")."""
    stalled, outs = (outs[0], outs[1:]) if stall is not None else (None, outs)
    lat = [x * 1000 for o in outs for x in o["latencies"]]
    asked = sum(len(o["latencies"]) + sum(o["errors"].values()) for o in outs)
    p50, p99 = np.percentile(lat, 50), np.percentile(lat, 99)
    out = {"observations": asked, "latency_p50_ms": round(p50, 2), "latency_p99_ms": round(p99, 2),
           "jitter_ms": round(p99 - p50, 2), "latency_std_ms": round(statistics.pstdev(lat), 2),
           "missed_deadlines": sum(o["missed"] for o in outs), "missed_share": round(sum(o["missed"] for o in outs) / asked, 4),
           "errors": merge([o["errors"] for o in outs]),
           "success_rate": round(sum(o["successes"] for o in outs) / sum(o["episodes"] for o in outs), 3),
           "in_process_success_rate": round(float(np.mean([expected[s] for o in outs for s in o["seeds"]])), 3),
           "episodes": sum(o["episodes"] for o in outs)}
    if stall is not None and stall.get("at"):
        at = stall["at"]
        during = [x * 1000 for o in outs for x, t in zip(o["latencies"], o["stamps"]) if at <= t < at + STALL_S]
        other = [x * 1000 for o in outs for x, t in zip(o["latencies"], o["stamps"]) if not at <= t < at + STALL_S]
        out["stall"] = {"stalled_robot_was_answered": stall.get("answer"),
                        "stalled_robot_success_rate": round(stalled["successes"] / stalled["episodes"], 3),
                        "others_p99_ms_during": round(float(np.percentile(during, 99)), 2) if during else None,
                        "others_p99_ms_otherwise": round(float(np.percentile(other, 99)), 2) if other else None}
    return out


def merge(dicts: list[dict]) -> dict:
    total = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    return total


def in_process_success(robots: int, episodes: int) -> dict[int, bool]:
    """Per seed of every robot's episodes: does the same policy, run in this process, succeed?"""
    from inferd.policy.model import load_policy
    from inferd.protocol.policy import ObservationSpec, check_observation
    files = load_policy(demo_policy_path(), threads=1)
    spec = ObservationSpec.from_dict(files.observation_spec)
    seeds = [10_000 + i * episodes + e for i in range(robots) for e in range(episodes)]
    task = ReacherTask(seeds[0])
    return {seed: bool(evaluate(lambda obs: files.predict([check_observation(spec, obs).values])[0], 1, seed,
                                task)["successes"]) for seed in seeds}


def machine() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    return f"{model}, {os.cpu_count()} cores"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--robots", default="1,4,16")
    p.add_argument("--episodes", type=int, default=6, help="episodes per robot per run")
    p.add_argument("--servers", default="inferd,openpi",
                   help="inferd (a replica process), inferd-in-process (the policy in the gateway's process), openpi")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--serve-openpi", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_openpi is not None:
        return serve_openpi(args.serve_openpi)
    meta_hz = json.loads((demo_policy_path() / "config.json").read_text())["control_hz"]
    deadline_ms = 1000 / meta_hz
    results = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "policy": DEMO_NAME,
               "deadline_ms": deadline_ms, "episodes_per_robot": args.episodes, "runs": []}
    robots_all = max(map(int, args.robots.split(",")))
    expected = in_process_success(robots_all, args.episodes)
    results["in_process_success_rate"] = round(float(np.mean(list(expected.values()))), 3)
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as servers:
        urls = {}  # every server runs from the start (idle ones take no CPU), so that they take turns in each cell
        for server in args.servers.split(","):
            work = Path(tmp) / server
            work.mkdir()
            urls[server] = servers.enter_context(openpi_server(work) if server == "openpi" else inferd_server(
                work, "in_process" if server == "inferd-in-process" else "local"))
        for rep in range(args.repeats):
            for robots in map(int, args.robots.split(",")):
                for stall in (False, True) if robots > 1 else (False,):
                    for server, (url, key) in urls.items():
                        port = int(url.split(":")[2].split("/")[0])
                        r = run(url, key, robots, args.episodes, deadline_ms, stall, port, expected)
                        r |= {"server": server, "robots": robots, "stalled": stall, "repeat": rep}
                        print(json.dumps(r), flush=True)
                        results["runs"].append(r)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        Path(args.out).with_suffix(".md").write_text(report(results))


def report(results: dict) -> str:
    """Medians over the repeats, per server, robots and stall; inferd over OpenPI as ratios."""
    def median(runs, key):
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    cells = {}
    for r in results["runs"]:
        cells.setdefault((r["robots"], r["stalled"]), {}).setdefault(r["server"], []).append(r)
    lines = [f"# Robot policies in closed loop: inferd vs OpenPI's reference server ({results['date']})", "",
             f"Machine: {results['machine']}; load generator, servers and simulators share it. Policy "
             f"`{results['policy']}` (one torch thread in each server), Reacher at 50 Hz, a chunk of 10 actions "
             f"per observation, deadline {results['deadline_ms']:g} ms after the observation, "
             f"{results['episodes_per_robot']} episodes per robot per run, medians of {max(r['repeat'] for r in results['runs']) + 1} runs. "
             f"In-process success of the same policy on the same episodes: {results['in_process_success_rate']}.", "",
             "| robots | network stall | server | latency p50 ms | p99 ms | jitter (p99-p50) ms | missed deadlines | "
             "success (in-process) | stalled robot was answered | others' p99 during the stall ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (robots, stalled), by_server in sorted(cells.items()):
        for server, runs in sorted(by_server.items()):
            stall = [r["stall"] for r in runs if "stall" in r]
            answered = ", ".join(sorted({str(x["stalled_robot_was_answered"]) for x in stall})) if stall else "-"
            during = statistics.median([x["others_p99_ms_during"] for x in stall if x["others_p99_ms_during"]]) \
                if stall and any(x["others_p99_ms_during"] for x in stall) else None
            lines.append(f"| {robots} | {'2 s, one robot' if stalled else '-'} | {server} | "
                         f"{median(runs, 'latency_p50_ms'):.2f} | {median(runs, 'latency_p99_ms'):.2f} | "
                         f"{median(runs, 'jitter_ms'):.2f} | {median(runs, 'missed_share') * 100:.1f} % | "
                         f"{median(runs, 'success_rate'):.3f} ({median(runs, 'in_process_success_rate'):.3f}) | "
                         f"{answered} | {'-' if during is None else f'{during:.2f}'} |")
    lines += ["", "Ratios over OpenPI (medians):", ""]
    for (robots, stalled), by_server in sorted(cells.items()):
        o = by_server.get("openpi")
        for server, i in sorted(by_server.items()) if o else ():
            if server != "openpi":
                lines.append(f"- {server}, {robots} robot(s){', one stalled' if stalled else ''}: p50 "
                             f"{median(i, 'latency_p50_ms') / median(o, 'latency_p50_ms'):.2f}x, p99 "
                             f"{median(i, 'latency_p99_ms') / median(o, 'latency_p99_ms'):.2f}x")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
