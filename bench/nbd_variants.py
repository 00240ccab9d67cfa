#!/usr/bin/env python3
"""Variants of strata (by serve flags or environment) side by side with nbdkit-file, one
workload, many interleaved rounds: for settings whose effect is smaller
than the machine's run-to-run swing.

Usage: bench/nbd_variants.py ROUNDS RW NAME[:--FLAG=VALUE,VAR=VALUE,...] ...
  RW: read | write (1M sequential, QD4, 4 s per round)
      randread | randwrite (4K random, QD32, 4 s per round)
  NAME "nbdkit" runs nbdkit-file; any other NAME runs strata serve with the
  flags (--FLAG=VALUE) and environment variables given (STRATA_BIN picks
  the binary; BIN=path per variant).
e.g. bench/nbd_variants.py 8 read nbdkit default "autotuned:--nbd-send-buffer=0"

Every server gets a 1 GiB volume (or file) of the same random data, listens
on an ephemeral 127.0.0.1 port and is stopped by PID. Each round runs fio's
nbd engine once against every server in turn (the order reversed every
other round, so going first or last in a round favours no one); the medians of MiB/s and of
server CPU per operation (utime+stime over the run / operations) are printed.
"""
import json, os, shutil, socket, statistics, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATA = os.environ.get("STRATA_BIN") or os.path.join(ROOT, "target", "release", "strata")


def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def curl(*args):
    return subprocess.run(["curl", "-sf", *args], capture_output=True).returncode == 0


def start(name, env, flags, work, seed):
    nbd = port()
    if name == "nbdkit":
        image = os.path.join(work, "nbdkit.img")
        shutil.copy(seed, image)
        proc = subprocess.Popen(["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(nbd), "file", image])
        uri = f"nbd://127.0.0.1:{nbd}/"
        for _ in range(200):
            if subprocess.run(["nbdinfo", "--size", uri], capture_output=True).returncode == 0:
                break
            time.sleep(0.05)
        return proc, uri
    api = port()
    env = dict(os.environ, STRATA_LOG="warn", STRATA_RAM_DIR=work, **env)
    binary = env.pop("BIN", STRATA)
    data_dir = os.path.join(work, name)
    proc = subprocess.Popen([binary, "serve", "--nfs", "127.0.0.1:0", "--data-dir", data_dir, "--nbd", f"127.0.0.1:{nbd}",
                             "--api", f"127.0.0.1:{api}", "--iscsi", "127.0.0.1:0", *flags],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    token = []
    for _ in range(200):
        path = os.path.join(data_dir, "api.token")
        token = ["-H", f"Authorization: Bearer {open(path).read().strip()}"] if os.path.exists(path) else []
        if curl(*token, f"http://127.0.0.1:{api}/v1/pools"):
            break
        time.sleep(0.05)
    assert curl(*token, "-X", "POST", "-H", "Content-Type: application/json", "-d",
                '{"name":"default/bench","size":1073741824}', f"http://127.0.0.1:{api}/v1/volumes")
    uri = f"nbd://127.0.0.1:{nbd}/default/bench"
    subprocess.run(["nbdcopy", "--flush", seed, uri], check=True)
    curl(*token, "-X", "POST", f"http://127.0.0.1:{api}/v1/pools/default/sync")
    return proc, uri


def main():
    shapes = {"read": ("1m", 4), "write": ("1m", 4), "randread": ("4k", 32), "randwrite": ("4k", 32)}
    if len(sys.argv) < 4 or sys.argv[2] not in shapes:
        sys.exit(__doc__)
    rounds, rw, specs = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    work = tempfile.mkdtemp(prefix="strata-variants.")
    seed = os.path.join(work, "seed.img")
    subprocess.run(["head", "-c", "1G", "/dev/urandom"], stdout=open(seed, "wb"), check=True)
    servers = []
    try:
        for spec in specs:
            name, _, assignments = spec.partition(":")
            items = [item for item in assignments.split(",") if item]
            flags = [item for item in items if item.startswith("--")]
            env = dict(item.split("=", 1) for item in items if not item.startswith("--"))
            proc, uri = start(name, env, flags, work, seed)
            servers.append((name, proc, uri, []))
        subprocess.run(["sync"])
        block, depth = shapes[rw]
        for round_ in range(rounds):
            for name, proc, uri, results in (servers if round_ % 2 == 0 else servers[::-1]):
                before = cpu_seconds(proc.pid)
                out = subprocess.run(["fio", "--name=b", "--ioengine=nbd", f"--uri={uri}", "--size=1g",
                                      "--time_based", "--runtime=4", "--norandommap", "--randrepeat=0",
                                      f"--rw={rw}", f"--bs={block}", f"--iodepth={depth}", "--output-format=json"],
                                     capture_output=True, text=True, check=True).stdout
                used = cpu_seconds(proc.pid) - before
                job = json.loads(out[out.index("{"):])["jobs"][0]["write" if "write" in rw else "read"]
                results.append((job["bw_bytes"] / 2**20, used * 1e6 / job["total_ios"]))
                if "write" in rw:
                    subprocess.run(["sync"])
            print(f"round {round_}: " + "  ".join(f"{n} {r[-1][0]:.0f}" for n, _, _, r in servers), flush=True)
    finally:
        for _, proc, _, _ in servers:
            proc.terminate()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    for name, _, _, results in servers:
        rates = [r[0] for r in results]
        print(f"{name:16} median {statistics.median(rates):6.1f} MiB/s (min {min(rates):.1f}, max {max(rates):.1f}), "
              f"server {statistics.median(r[1] for r in results):.0f} µs CPU/op")


if __name__ == "__main__":
    main()
