#!/usr/bin/env python3
"""Container images without a Docker engine or a registry.

    hack/image.py build -f Dockerfile -t localhost/NAME:TAG [--build-arg K=V]... [--target STAGE] CONTEXT
    hack/image.py pause            build and import the pause image the cluster's containerd uses
    hack/image.py ls               images in containerd's k8s.io namespace
    hack/image.py has REF          exit 0 when REF is in containerd

How `build` works: each stage starts from a cached Debian root filesystem (debootstrap), RUN steps
run in a chroot inside private mount and PID namespaces (network shared with the host), and the
final root filesystem becomes ONE uncompressed layer of an OCI image that is streamed into
`ctr images import` (containerd's `k8s.io` namespace, where the kubelet finds it). No compression:
gzip of a multi-GB torch layer costs minutes on 2 cores and buys nothing locally.

FROM mapping (there is no registry to pull from):
    python:3.11[-slim][-bookworm], debian:bookworm[-slim], debian:12[-slim]
        -> Debian $DEBIAN_SUITE minbase + python3, python3-venv, ca-certificates, netbase
           (Debian's python3 is /usr/bin/python3; /usr/local/bin/python{,3} link to it, as in the
           python image; `python3 -m venv` works, system pip is deliberately absent)
    scratch -> empty
    <earlier stage name> -> that stage's result

Supported instructions: ARG FROM (multi-stage, AS) ENV WORKDIR COPY/ADD (local files, --from,
--chown, --chmod) RUN (shell and exec form; `--mount=type=cache,target=DIR`, where
target=/root/.cache/pip binds the host's pip cache so big wheels download once) USER ENTRYPOINT CMD
LABEL EXPOSE SHELL STOPSIGNAL; .dockerignore is honoured. Build-time only (never in the image): the
host's CA bundle (TLS-intercepting proxies) and proxy/pip-index environment variables.

Caching: every step has a key chained from the base, the instruction, the build args/env it sees
and, for COPY, the content of the copied files. The root filesystem is snapshotted after each RUN
that is followed by more filesystem work, so changing only the source code re-runs only the COPY.
An unchanged image whose ref already points to the same build in containerd is a no-op.
"""
from __future__ import annotations

import argparse
import fcntl
import fnmatch
import glob
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster  # noqa: E402  (paths, containerd socket, versions)

CACHE = cluster.CACHE
BUILD_CACHE = CACHE / "image-build"
STEPS = BUILD_CACHE / "steps"
REFS = BUILD_CACHE / "refs"
HOST_PIP_CACHE = Path.home() / ".cache" / "pip"

BASE_REVISION = 1  # bump when BASE_PACKAGES or the post-processing below changes
BASE_PACKAGES = ["python3", "python3-venv", "ca-certificates", "netbase"]
DEBIAN_MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_IMAGES = [  # Dockerfile FROM references the Debian base stands in for
    r"(docker\.io/)?(library/)?python:3\.11(\.\d+)?(-slim)?(-bookworm)?",
    r"(docker\.io/)?(library/)?debian:(bookworm|12)(-slim)?",
]
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Passed from the host into RUN steps only (like Docker's predefined build args).
BUILD_ENV_PASSTHROUGH = ["http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
                         "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_DEFAULT_TIMEOUT"]
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BUILD_CA_PATH = "/run/ddpjob-build-ca.crt"  # where RUN steps see the host bundle; removed afterwards


class BuildError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[image {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sha256(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.encode())
        h.update(b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# containerd side

def containerd_images() -> dict[str, str]:
    """ref -> manifest digest of everything in the k8s.io namespace (starts containerd if needed)."""
    cluster.ensure_containerd()
    out = cluster.ctr("images", "ls").stdout.splitlines()[1:]
    return {ln.split()[0]: ln.split()[2] for ln in out if ln.strip()}


def has_image(ref: str) -> bool:
    return ref in containerd_images()


def check_ref(ref: str) -> None:
    # The CRI normalises short names to docker.io/library/...; a local image must be fully qualified,
    # and :latest would make the kubelet try to pull.
    if not re.fullmatch(r"[a-z0-9.-]+(:\d+)?/[a-z0-9._/-]+:[A-Za-z0-9_.-]+", ref) or ref.endswith(":latest"):
        raise BuildError(f"image ref {ref!r} must be fully qualified with a version tag, "
                         "e.g. localhost/ddp-trainer:0.1.0 (never :latest)")


def import_oci(ref: str, layer: Path, diff_id: str, config: dict) -> str:
    """Stream an OCI image archive (one uncompressed layer) into containerd; returns the manifest digest."""
    config = {**config, "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]}}
    config_bytes = json.dumps(config, sort_keys=True).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": f"sha256:{hashlib.sha256(config_bytes).hexdigest()}", "size": len(config_bytes)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": f"sha256:{diff_id}", "size": layer.stat().st_size}],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    manifest_digest = f"sha256:{hashlib.sha256(manifest_bytes).hexdigest()}"
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": manifest["mediaType"], "digest": manifest_digest, "size": len(manifest_bytes),
        "platform": {"architecture": config["architecture"], "os": config["os"]},
        "annotations": {"io.containerd.image.name": ref,
                        "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]}}]}

    cluster.ensure_containerd()
    proc = subprocess.Popen(["ctr", "--address", cluster.CONTAINERD_SOCK, "--namespace", cluster.K8S_NAMESPACE,
                             "images", "import", "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)

    def add(tar: tarfile.TarFile, name: str, data: bytes | None = None, path: Path | None = None):
        info = tarfile.TarInfo(name)
        info.mtime = int(time.time())
        if path is not None:
            info.size = path.stat().st_size
            with open(path, "rb") as f:
                tar.addfile(info, f)
        else:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

    try:
        with tarfile.open(fileobj=proc.stdin, mode="w|", copybufsize=4 << 20) as tar:
            add(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
            add(tar, f"blobs/sha256/{diff_id}", path=layer)
            add(tar, f"blobs/sha256/{manifest['config']['digest'][7:]}", config_bytes)
            add(tar, f"blobs/sha256/{manifest_digest[7:]}", manifest_bytes)
            add(tar, "index.json", json.dumps(index).encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    out = proc.stdout.read().decode(errors="replace")
    if proc.wait() != 0:
        raise BuildError(f"ctr images import failed:\n{out}")
    if containerd_images().get(ref) != manifest_digest:
        raise BuildError(f"import finished but containerd does not list {ref} at {manifest_digest}:\n{out}")
    return manifest_digest


def tar_layer(rootfs: Path, out: Path) -> str:
    """Tar a root filesystem into out (uncompressed) and return its sha256 in the same pass."""
    h = hashlib.sha256()
    tar = subprocess.Popen(["tar", "--numeric-owner", "--xattrs", "--xattrs-include=security.capability",
                            "--sort=name", "-C", str(rootfs), "-cf", "-", "."], stdout=subprocess.PIPE)
    with open(out, "wb") as f:
        while chunk := tar.stdout.read(4 << 20):
            h.update(chunk)
            f.write(chunk)
    if tar.wait() != 0:
        raise BuildError(f"tar of {rootfs} failed")
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# pause image

def go_binary() -> str:
    """The Go hack/build-binaries.sh builds with: a new enough one on PATH, else the pinned toolchain
    (hack/install-go.py; a fresh machine has no `go` on PATH)."""
    goroot = subprocess.run([sys.executable, str(Path(__file__).with_name("install-go.py"))],
                            stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
    return str(Path(goroot) / "bin" / "go")


def ensure_pause() -> str:
    """Build Kubernetes' own pause.c statically and import it as cluster.PAUSE_IMAGE (no pull possible)."""
    ref = cluster.PAUSE_IMAGE
    if has_image(ref):
        return ref
    kube = cluster.versions()["KUBE_VERSION"]
    out = CACHE / f"pause-{cluster.PAUSE_VERSION}"
    binary = out / "pause"
    if not binary.exists():
        go = go_binary()
        modcache = subprocess.run([go, "env", "GOMODCACHE"], capture_output=True, text=True,
                                  check=True).stdout.strip()
        src = Path(modcache) / f"k8s.io/kubernetes@{kube}/build/pause/linux/pause.c"
        if not src.exists():
            subprocess.run([go, "mod", "download", f"k8s.io/kubernetes@{kube}"], check=True,
                           env={**os.environ, "GOFLAGS": "-mod=mod"}, cwd=tempfile.gettempdir())
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run(["gcc", "-Os", "-static", "-Wall", "-Werror", f'-DVERSION=v{cluster.PAUSE_VERSION}-ddpjob',
                        "-o", str(binary), str(src)], check=True)
        subprocess.run(["strip", str(binary)], check=False)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        root = Path(tmp) / "rootfs"
        root.mkdir()
        shutil.copy2(binary, root / "pause")
        layer = Path(tmp) / "layer.tar"
        diff_id = tar_layer(root, layer)
        config = {"architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
                  "config": {"Entrypoint": ["/pause"], "User": "65535:65535"}}
        import_oci(ref, layer, diff_id, config)
    log(f"imported {ref}")
    return ref


# --------------------------------------------------------------------------------------------
# base root filesystem

def base_rootfs_path() -> Path:
    suite = cluster.versions().get("DEBIAN_SUITE", "bookworm")
    return CACHE / f"rootfs-{suite}-v{BASE_REVISION}"


def base_rootfs() -> Path:
    """The cached Debian base, made on first use (call with the build lock held)."""
    suite = cluster.versions().get("DEBIAN_SUITE", "bookworm")
    d = base_rootfs_path()
    if (d / "etc" / "os-release").exists() and not d.with_suffix(".tmp").exists():
        return d
    tmp = d.with_suffix(".tmp")
    if not (tmp / "usr" / "bin" / "python3").exists():
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"debootstrap {suite} minbase + {' '.join(BASE_PACKAGES)} (once; about 2 minutes)")
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", suite,
                        str(tmp), DEBIAN_MIRROR], check=True, stdout=subprocess.DEVNULL)
    # Make it look like an image, not a host: no apt caches, no host resolver or hostname.
    for p in ["var/cache/apt/archives", "var/lib/apt/lists"]:
        for f in (tmp / p).glob("*"):
            if f.is_file():
                f.unlink()
    for f in (tmp / "var/cache/apt").glob("*.bin"):
        f.unlink()
    (tmp / "etc/resolv.conf").write_text("")
    (tmp / "etc/hostname").unlink(missing_ok=True)
    for name in ("python", "python3"):  # as in the python image
        link = tmp / "usr/local/bin" / name
        if not link.is_symlink():
            link.symlink_to("/usr/bin/python3")
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    return d


# --------------------------------------------------------------------------------------------
# Dockerfile parsing

@dataclass
class Instruction:
    cmd: str
    args: str  # the raw argument text (flags removed)
    flags: dict[str, list[str]]
    line: int

    def json_args(self) -> list[str] | None:
        try:
            v = json.loads(self.args)
        except ValueError:
            return None
        return v if isinstance(v, list) and all(isinstance(x, str) for x in v) else None


def parse_dockerfile(text: str) -> list[Instruction]:
    out, buf, start = [], "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue  # comment lines inside a continuation are dropped, as Docker does
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        cmd, _, rest = buf.strip().partition(" ")
        flags: dict[str, list[str]] = {}
        rest = rest.strip()
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            k, _, v = flag[2:].partition("=")
            flags.setdefault(k, []).append(v)
            rest = rest.strip()
        out.append(Instruction(cmd.upper(), rest, flags, start))
        buf = ""
    return out


_VAR = re.compile(r"\\\$|\$(?:\{(\w+)(?::([-+])([^}]*))?\}|(\w+))")


def expand(s: str, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        if m.group(0) == "\\$":
            return "$"
        name = m.group(1) or m.group(4)
        val = env.get(name, "")
        if m.group(2) == "-":
            return val or m.group(3)
        if m.group(2) == "+":
            return m.group(3) if val else ""
        return val
    return _VAR.sub(sub, s)


def key_values(args: str, env: dict[str, str]) -> list[tuple[str, str]]:
    """ENV/LABEL/ARG arguments: `k=v k2="v 2"` or the legacy `k v`."""
    parts = shlex.split(args, posix=True)
    if len(parts) >= 1 and "=" not in parts[0]:
        name, _, value = args.strip().partition(" ")
        return [(name, expand(value.strip(), env))]
    return [(k, expand(v, env)) for k, _, v in (p.partition("=") for p in parts)]


# --------------------------------------------------------------------------------------------
# build

@dataclass
class Stage:
    name: str
    index: int
    rootfs: Path | None = None
    key: str = ""
    config: dict = field(default_factory=dict)


def _dockerignore(context: Path) -> list[tuple[bool, str]]:
    f = context / ".dockerignore"
    if not f.exists():
        return []
    rules = []
    for line in f.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            neg = line.startswith("!")
            rules.append((neg, os.path.normpath(line.lstrip("!").strip("/"))))
    return rules


def _ignored(rel: str, rules: list[tuple[bool, str]]) -> bool:
    ignored = False
    for neg, pat in rules:
        pat_re = fnmatch.translate(pat).replace(".*", "[^/]*").replace("[^/]*[^/]*", ".*")
        parts = rel.split("/")
        # a pattern matches the path or any of its parent directories
        if any(re.match(pat_re, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            ignored = not neg
    return ignored


def _files_for_copy(srcs: list[str], base: Path, rules) -> list[tuple[Path, str]]:
    """(absolute source, path relative to base) of every file/dir/link a COPY would take."""
    picked = []
    for s in srcs:
        matches = sorted(glob.glob(str(base / s.lstrip("/")))) if glob.has_magic(s) else [str(base / s.lstrip("/"))]
        matches = [m for m in matches if os.path.lexists(m)]
        if not matches:
            raise BuildError(f"COPY source {s!r} not found in {base}")
        for m in matches:
            p = Path(os.path.normpath(m))
            if base != p and base not in p.parents:
                raise BuildError(f"COPY source {s!r} is outside the build context")
            picked.append(p)
    out = []
    for p in picked:
        if p.is_dir() and not p.is_symlink():
            for dirpath, dirnames, filenames in os.walk(p):
                dirnames.sort()
                for n in sorted(dirnames + filenames):
                    full = Path(dirpath) / n
                    rel = str(full.relative_to(base))
                    if not _ignored(rel, rules):
                        out.append((full, str(full.relative_to(p))))
                    elif n in dirnames:
                        dirnames.remove(n)
        elif not _ignored(str(p.relative_to(base)), rules):
            out.append((p, ""))
    return out


def _content_hash(entries: list[tuple[Path, str]]) -> str:
    h = hashlib.sha256()
    for full, rel in entries:
        st = full.lstat()
        h.update(f"{rel}\0{st.st_mode}\0".encode())
        if full.is_symlink():
            h.update(os.readlink(full).encode())
        elif full.is_file():
            with open(full, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
    return h.hexdigest()


def _lookup_user(rootfs: Path, spec: str) -> tuple[int, int]:
    user, _, group = spec.partition(":")

    def find(db: str, name: str, field_: int) -> int | None:
        if name.isdigit():
            return int(name)
        try:
            for line in (rootfs / "etc" / db).read_text().splitlines():
                parts = line.split(":")
                if parts[0] == name:
                    return int(parts[field_])
        except OSError:
            pass
        return None

    uid = find("passwd", user, 2)
    if uid is None:
        raise BuildError(f"user {user!r} does not exist in the image")
    if group:
        gid = find("group", group, 2)
        if gid is None:
            raise BuildError(f"group {group!r} does not exist in the image")
    else:
        gid = next((int(ln.split(":")[3]) for ln in (rootfs / "etc/passwd").read_text().splitlines()
                    if ln.split(":")[0] == user or ln.split(":")[2] == str(uid)), uid) \
            if (rootfs / "etc/passwd").exists() else uid
    return uid, gid


def _run_step(rootfs: Path, argv: list[str], env: dict[str, str], workdir: str, user: str,
              cache_mounts: list[str]) -> None:
    """Run argv chrooted in rootfs, inside fresh mount and PID namespaces (mounts and stray
    processes vanish with them); the network is the host's."""
    uid, gid = _lookup_user(rootfs, user or "0")
    binds: list[tuple[str, str, bool]] = []  # host path, path in rootfs, created-by-us
    created: list[Path] = []
    run_env = dict(env)
    if "HOME" not in run_env:  # as Docker does: the user's home from the image's passwd, else /
        homes = [ln.split(":") for ln in (rootfs / "etc/passwd").read_text().splitlines()
                 if ln.count(":") >= 6] if (rootfs / "etc/passwd").exists() else []
        run_env["HOME"] = next((f[5] for f in homes if f[2] == str(uid)), "/")
    for k in BUILD_ENV_PASSTHROUGH:
        if k in os.environ and k not in run_env:
            run_env[k] = os.environ[k]
    if HOST_CA_BUNDLE.exists():
        binds.append((str(HOST_CA_BUNDLE), BUILD_CA_PATH, True))
        for k in ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
            run_env.setdefault(k, BUILD_CA_PATH)
    for target in cache_mounts:
        host = HOST_PIP_CACHE if target.rstrip("/") == "/root/.cache/pip" else \
            BUILD_CACHE / "mounts" / sha256(target)[:16]
        host.mkdir(parents=True, exist_ok=True)
        binds.append((str(host), target, False))
    script = ["set -e", f"R={shlex.quote(str(rootfs))}",
              'mount -t proc proc "$R/proc"', 'mount --rbind /dev "$R/dev"',
              'mount -t sysfs -o ro sysfs "$R/sys"',
              'mount --bind /etc/resolv.conf "$R/etc/resolv.conf"']
    for host, inside, is_file in binds:
        dst = rootfs / inside.lstrip("/")
        if not os.path.lexists(dst):
            created.append(dst)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.touch() if is_file else dst.mkdir(parents=True)
        script.append(f"mount --bind {shlex.quote(host)} {shlex.quote(str(dst))}")
    envargs = " ".join(shlex.quote(f"{k}={v}") for k, v in run_env.items())
    inner = f"mkdir -p {shlex.quote(workdir)} && cd {shlex.quote(workdir)} && exec \"$@\""
    script.append(f'exec chroot --userspec={uid}:{gid} --groups={gid} "$R" /usr/bin/env -i {envargs} '
                  f"/bin/sh -c {shlex.quote(inner)} sh " + " ".join(shlex.quote(a) for a in argv))
    try:
        p = subprocess.run(["unshare", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private",
                            "sh", "-c", "\n".join(script)])
    finally:
        for c in reversed(created):
            if c.is_dir():
                shutil.rmtree(c, ignore_errors=True)
            else:
                c.unlink(missing_ok=True)
    if p.returncode != 0:
        raise BuildError(f"RUN {' '.join(argv)!r} exited {p.returncode}")


def _copy_into(rootfs: Path, entries: list[tuple[Path, str]], srcs_are_single_file: bool, dest: str,
               owner: tuple[int, int], chmod: int | None) -> None:
    dst = rootfs / dest.lstrip("/")
    if srcs_are_single_file and not dest.endswith("/") and not dst.is_dir():
        targets = [(entries[0][0], dst)]
    else:
        targets = [(full, dst / (rel or full.name)) for full, rel in entries]
    for full, target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_dir() and not target.is_symlink() and (full.is_symlink() or not full.is_dir()):
            shutil.rmtree(target)
        elif os.path.lexists(target) and not target.is_dir():
            target.unlink()
        if full.is_symlink():
            os.symlink(os.readlink(full), target)
        elif full.is_dir():
            target.mkdir(exist_ok=True)
            shutil.copystat(full, target)
        else:
            shutil.copy2(full, target)
        os.lchown(target, *owner)
        if chmod is not None and not full.is_symlink():
            target.chmod(chmod)


def remove_dead_builds() -> None:
    """Delete the work directories of builds whose process is gone (killed mid-build): each holds a
    multi-GB root filesystem and layer, and a full disk makes the kubelet evict pods."""
    for work in BUILD_CACHE.glob("build-*"):
        pid = work.name.split("-")[1]
        if not pid.isdigit() or not Path(f"/proc/{pid}").exists():
            shutil.rmtree(work, ignore_errors=True)


class Builder:
    def __init__(self, dockerfile: Path, context: Path, build_args: dict[str, str], target: str | None):
        BUILD_CACHE.mkdir(parents=True, exist_ok=True)
        self.dockerfile = dockerfile
        self.context = context.resolve()
        self.build_args = build_args
        self.target = target
        self.instructions = parse_dockerfile(dockerfile.read_text())
        self.rules = _dockerignore(self.context)
        self.stages: dict[str, Stage] = {}
        remove_dead_builds()
        self.work = Path(tempfile.mkdtemp(prefix=f"build-{os.getpid()}-", dir=BUILD_CACHE))
        self.used_steps: list[str] = []

    # A stage is planned (keys, config) and executed in one walk; filesystem work before the last
    # cached snapshot is skipped and the snapshot copied in instead.
    def build(self, execute: bool = True) -> Stage:
        global_args: dict[str, str] = {}
        groups: list[tuple[Instruction, list[Instruction]]] = []
        for ins in self.instructions:
            if ins.cmd == "FROM":
                groups.append((ins, []))
            elif not groups:
                if ins.cmd != "ARG":
                    raise BuildError(f"line {ins.line}: only ARG may precede FROM")
                for k, v in key_values(ins.args, global_args):
                    global_args[k] = self.build_args.get(k, v)
            else:
                groups[-1][1].append(ins)
        if not groups:
            raise BuildError("no FROM instruction")
        final = None
        for i, (frm, body) in enumerate(groups):
            words = expand(frm.args, global_args).split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(i)
            final = self.build_stage(Stage(name, i), words[0], body, global_args, execute)
            self.stages[name] = self.stages[str(i)] = final
            if self.target and name == self.target:
                break
        return final

    def _start_from(self, stage: Stage, base: str, execute: bool) -> None:
        if base in self.stages:
            src = self.stages[base]
            stage.key, stage.config = sha256("stage", src.key), json.loads(json.dumps(src.config))
            stage.rootfs = src.rootfs  # copied lazily when this stage first touches the filesystem
            return
        if base == "scratch":
            stage.key, stage.config, stage.rootfs = sha256("scratch"), {"Env": {"PATH": DEFAULT_PATH}}, None
            return
        if not any(re.fullmatch(p, base) for p in BASE_IMAGES):
            raise BuildError(f"FROM {base}: no local stand-in (supported: python:3.11[-slim][-bookworm], "
                             "debian:bookworm[-slim], scratch, an earlier stage)")
        root = base_rootfs() if execute else base_rootfs_path()
        stage.key = sha256("base", str(root), str(BASE_REVISION), *BASE_PACKAGES)
        stage.config = {"Env": {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"}, "Cmd": ["python3"]}
        stage.rootfs = root

    def build_stage(self, stage: Stage, base: str, body: list[Instruction], global_args: dict[str, str],
                    execute: bool) -> Stage:
        self._start_from(stage, base, execute)
        cfg = stage.config
        cfg.setdefault("Env", {})
        args: dict[str, str] = {}
        shell = ["/bin/sh", "-c"]
        own_root = self.work / f"stage-{stage.index}"
        materialized = False
        # Steps worth resuming from (a trailing WORKDIR mkdir is not worth a multi-GB snapshot).
        fs_ops = [i for i, ins in enumerate(body) if ins.cmd in ("RUN", "COPY", "ADD")]

        # Plan: compute the chained key of each instruction; find the last RUN with a snapshot.
        plans = []
        key = stage.key
        for i, ins in enumerate(body):
            env = {**args, **cfg["Env"]}  # ENV wins over ARG, as in Docker
            extra = ""
            if ins.cmd in ("COPY", "ADD"):
                extra = self._copy_key(ins, env)
            elif ins.cmd == "RUN":
                extra = json.dumps([env, cfg.get("WorkingDir", "/"), cfg.get("User", ""), shell])
            key = sha256(key, ins.cmd, json.dumps(ins.flags, sort_keys=True), ins.args, extra)
            plans.append((key, json.loads(json.dumps({"cfg": cfg, "args": args, "shell": shell}))))
            self._apply_metadata(ins, cfg, args, global_args, shell, env)
        if not execute:
            stage.key = key
            return stage
        resume = -1
        for i in range(len(body) - 1, -1, -1):
            if body[i].cmd == "RUN" and (STEPS / plans[i][0] / ".complete").exists():
                resume = i
                break

        # Execute filesystem work after the resume point.
        if resume >= 0:
            log(f"stage {stage.name}: resuming after cached step {resume + 1}/{len(body)} ({body[resume].cmd})")
            self._materialize(STEPS / plans[resume][0] / "rootfs", own_root)
            materialized = True
        for i, ins in enumerate(body):
            if i <= resume or ins.cmd not in ("RUN", "COPY", "ADD", "WORKDIR"):
                continue
            if not materialized:
                self._materialize(stage.rootfs, own_root)
                materialized = True
            state = plans[i][1]
            c = state["cfg"]
            env = {**state["args"], **c["Env"]}
            log(f"stage {stage.name} step {i + 1}/{len(body)}: {ins.cmd} {ins.args[:100]}")
            if ins.cmd == "WORKDIR":
                wd = self._resolve_workdir(expand(ins.args, env), c)
                (own_root / wd.lstrip("/")).mkdir(parents=True, exist_ok=True)
            elif ins.cmd in ("COPY", "ADD"):
                self._copy(ins, env, c, own_root)
            elif ins.cmd == "RUN":
                argv = ins.json_args() or [*state["shell"], ins.args]
                mounts = []
                for m in ins.flags.get("mount", []):
                    opts = dict(o.partition("=")[::2] for o in m.split(","))
                    if opts.get("type") != "cache" or "target" not in opts:
                        raise BuildError(f"line {ins.line}: only --mount=type=cache,target=... is supported")
                    mounts.append(opts["target"])
                _run_step(own_root, argv, env, c.get("WorkingDir", "/"), c.get("User", ""), mounts)
                # Snapshot only when more filesystem work follows (else the image itself is the cache).
                if any(j > i for j in fs_ops):
                    self._snapshot(own_root, plans[i][0])
            if ins.cmd == "RUN" and (STEPS / plans[i][0] / ".complete").exists():
                self.used_steps.append(plans[i][0])
        if resume >= 0:
            self.used_steps.append(plans[resume][0])
        stage.key = key
        if materialized:
            stage.rootfs = own_root
        return stage

    def _apply_metadata(self, ins, cfg, args, global_args, shell, env) -> None:
        if ins.cmd == "ARG":
            for k, v in key_values(ins.args, env):
                args[k] = self.build_args.get(k, v if v or "=" in ins.args else global_args.get(k, ""))
        elif ins.cmd == "ENV":
            cfg["Env"].update(key_values(ins.args, env))
        elif ins.cmd == "WORKDIR":
            cfg["WorkingDir"] = self._resolve_workdir(expand(ins.args, env), cfg)
        elif ins.cmd == "USER":
            cfg["User"] = expand(ins.args, env)
        elif ins.cmd in ("ENTRYPOINT", "CMD"):
            value = ins.json_args()
            if value is None:
                value = [*shell, ins.args]
            cfg["Entrypoint" if ins.cmd == "ENTRYPOINT" else "Cmd"] = value
            if ins.cmd == "ENTRYPOINT" and not cfg.get("_cmd_set"):
                cfg.pop("Cmd", None)  # an ENTRYPOINT resets the CMD inherited from the base
            if ins.cmd == "CMD":
                cfg["_cmd_set"] = True
        elif ins.cmd == "LABEL":
            cfg.setdefault("Labels", {}).update(key_values(ins.args, env))
        elif ins.cmd == "EXPOSE":
            for p in expand(ins.args, env).split():
                cfg.setdefault("ExposedPorts", {})[p if "/" in p else f"{p}/tcp"] = {}
        elif ins.cmd == "SHELL":
            shell[:] = ins.json_args() or shell
        elif ins.cmd == "STOPSIGNAL":
            cfg["StopSignal"] = expand(ins.args, env)
        elif ins.cmd in ("RUN", "COPY", "ADD"):
            pass
        elif ins.cmd in ("HEALTHCHECK", "VOLUME", "MAINTAINER"):
            log(f"line {ins.line}: {ins.cmd} ignored (Kubernetes does not use it)")
        else:
            raise BuildError(f"line {ins.line}: unsupported instruction {ins.cmd}")

    @staticmethod
    def _resolve_workdir(wd: str, cfg: dict) -> str:
        return os.path.normpath(wd if wd.startswith("/") else os.path.join(cfg.get("WorkingDir", "/"), wd))

    def _copy_sources(self, ins: Instruction, env: dict[str, str]):
        words = ins.json_args() or shlex.split(ins.args)
        words = [expand(w, env) for w in words]
        if len(words) < 2:
            raise BuildError(f"line {ins.line}: {ins.cmd} needs a source and a destination")
        if any(re.match(r"^[a-z]+://", w) for w in words[:-1]):
            raise BuildError(f"line {ins.line}: {ins.cmd} from a URL is not supported offline")
        frm = ins.flags.get("from", [None])[0]
        if frm is not None:
            if frm not in self.stages or self.stages[frm].rootfs is None:
                raise BuildError(f"line {ins.line}: COPY --from={frm}: no such stage (images are not supported)")
            base, rules = self.stages[frm].rootfs, []
        else:
            base, rules = self.context, self.rules
        return words[:-1], words[-1], _files_for_copy(words[:-1], base, rules), frm

    def _copy_key(self, ins: Instruction, env: dict[str, str]) -> str:
        frm = ins.flags.get("from", [None])[0]
        if frm is not None:  # the source stage's key already determines what is copied
            if frm not in self.stages:
                raise BuildError(f"line {ins.line}: COPY --from={frm}: no such stage")
            return self.stages[frm].key
        _, _, entries, _ = self._copy_sources(ins, env)
        return _content_hash(entries)

    def _copy(self, ins: Instruction, env: dict[str, str], cfg: dict, root: Path) -> None:
        srcs, dest, entries, _ = self._copy_sources(ins, env)
        if not dest.startswith("/"):
            dest = os.path.join(cfg.get("WorkingDir", "/"), dest) + ("/" if dest.endswith("/") else "")
        owner = _lookup_user(root, ins.flags["chown"][0]) if "chown" in ins.flags else (0, 0)
        chmod = int(ins.flags["chmod"][0], 8) if "chmod" in ins.flags else None
        single = len(entries) == 1 and entries[0][1] == "" and not glob.has_magic(srcs[0]) and len(srcs) == 1
        _copy_into(root, entries, single, dest, owner, chmod)

    @staticmethod
    def _materialize(src: Path | None, dst: Path) -> None:
        shutil.rmtree(dst, ignore_errors=True)
        if src is None:
            dst.mkdir(parents=True)
            return
        subprocess.run(["cp", "-a", "--reflink=auto", str(src), str(dst)], check=True)

    @staticmethod
    def _snapshot(root: Path, key: str) -> None:
        d = STEPS / key
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        subprocess.run(["cp", "-a", "--reflink=auto", str(root), str(d / "rootfs")], check=True)
        (d / ".complete").touch()

    def cleanup(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def _ref_record(ref: str) -> Path:
    return REFS / (re.sub(r"[^A-Za-z0-9_.-]", "_", ref) + ".json")


def _prune_steps() -> None:
    """Keep only snapshots some image's latest build used."""
    keep = set()
    for rec in REFS.glob("*.json"):
        keep.update(json.loads(rec.read_text()).get("steps", []))
    for d in STEPS.glob("*") if STEPS.exists() else []:
        if d.name not in keep:
            shutil.rmtree(d, ignore_errors=True)


def build(dockerfile: str | Path, ref: str, context: str | Path, build_args: dict[str, str] | None = None,
          target: str | None = None) -> str:
    """Build a Dockerfile into containerd's k8s.io namespace as `ref`; returns the manifest digest."""
    check_ref(ref)
    t0 = time.monotonic()
    for d in (BUILD_CACHE, STEPS, REFS):
        d.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        raise BuildError("image builds need root (chroot, mounts, containerd)")
    b = Builder(Path(dockerfile), Path(context), build_args or {}, target)
    lock = None
    try:
        # Quick path: a dry run gives the final key; same key as the build containerd already
        # holds under this ref means nothing to do.
        record = _ref_record(ref)
        prev = json.loads(record.read_text()) if record.exists() else {}
        planned = b.build(execute=False)
        if prev.get("key") == planned.key and containerd_images().get(ref) == prev.get("digest"):
            log(f"{ref} unchanged ({time.monotonic() - t0:.1f}s)")
            return prev["digest"]
        # One build at a time per machine: builds share the base, the step snapshots (pruned at
        # the end of each build) and two CPU cores.
        lock = open(BUILD_CACHE / ".lock", "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        prev = json.loads(record.read_text()) if record.exists() else {}
        if prev.get("key") == planned.key and containerd_images().get(ref) == prev.get("digest"):
            log(f"{ref} was just built by another build")
            return prev["digest"]
        b.stages.clear()
        stage = b.build(execute=True)
        if stage.rootfs is None:  # FROM scratch with nothing added
            stage.rootfs = b.work / "empty"
            stage.rootfs.mkdir()
        log(f"writing layer for {ref}")
        layer = b.work / "layer.tar"
        diff_id = tar_layer(stage.rootfs, layer)
        cfg = {k: v for k, v in stage.config.items() if not k.startswith("_")}
        cfg["Env"] = [f"{k}={v}" for k, v in cfg.get("Env", {}).items()]
        config = {"architecture": "amd64", "os": "linux",
                  "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "config": cfg, "history": [{"created_by": f"hack/image.py build -f {dockerfile}"}]}
        log(f"importing {ref} ({layer.stat().st_size / 2**20:.0f} MiB)")
        digest = import_oci(ref, layer, diff_id, config)
        record.write_text(json.dumps({"key": stage.key, "digest": digest, "steps": b.used_steps}))
        _prune_steps()
        log(f"built {ref} {digest[:19]} in {time.monotonic() - t0:.1f}s")
        return digest
    finally:
        b.cleanup()
        if lock is not None:
            lock.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("-f", "--file", help="Dockerfile (default CONTEXT/Dockerfile)")
    b.add_argument("-t", "--tag", required=True, help="fully qualified ref, e.g. localhost/name:0.1.0")
    b.add_argument("--build-arg", action="append", default=[], metavar="K=V")
    b.add_argument("--target")
    b.add_argument("context")
    sub.add_parser("pause")
    sub.add_parser("ls")
    h = sub.add_parser("has")
    h.add_argument("ref")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "build":
            args = dict(kv.partition("=")[::2] for kv in a.build_arg)
            build(a.file or Path(a.context) / "Dockerfile", a.tag, a.context, args, a.target)
        elif a.cmd == "pause":
            print(ensure_pause())
        elif a.cmd == "ls":
            for ref, digest in sorted(containerd_images().items()):
                if not ref.startswith("sha256:"):
                    print(f"{ref}\t{digest}")
        elif a.cmd == "has":
            return 0 if has_image(a.ref) else 1
    except (BuildError, cluster.ClusterError, subprocess.CalledProcessError) as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
