"""Task images: stacks of content-addressed tar layers compressed with zstd (gzip for comparison).

An image is what a sandbox's root folder is made of. It has two layers:

1. the *base layer*, shared by every image: the skeleton of a Linux root (``/etc/passwd``,
   ``/etc/hosts``, a git config, empty ``/tmp``, ``/workspace``, ``/home/sandbox`` and the mount
   points) with ``/bin``, ``/lib``... as symlinks into ``/usr``, and ``pxd`` at ``/opt/pxd/pxd.py``;
2. the *task layer*: the task's repository (with its ``.git``) under ``/workspace``.

The host's ``/usr`` (python3, git, coreutils) is not in the image: every runtime binds it read-only,
so images stay small. Anything else a task runs on comes from the image's layers, or from a host
toolchain the image declares (``toolchains`` in its manifest; :mod:`sandboxes.toolchain`). On a
cluster the base layer is the place to put ``/usr`` instead.

Layers are stored once in an :class:`ImageStore` as ``blobs/sha256/<digest>.tar.zst`` (digest of
the compressed blob, like OCI) and known by their ``diff_id`` (digest of the uncompressed tar),
which names the unpacked copy in the node-local :class:`~sandboxes.cache.LayerCache`. An image is
a JSON manifest ``images/<name>.json`` listing its layers, base first.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import stat
import subprocess
import tarfile
import tempfile
import threading
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping

import zstandard

from sandboxes.errors import SandboxError
from sandboxes.programs import shipped_source

COMPRESSIONS = ("zstd", "gzip")
SUFFIX = {"zstd": ".tar.zst", "gzip": ".tar.gz"}
WORKDIR = "/workspace"
SANDBOX_UID = 1000
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class ImageError(SandboxError):
    """An image or layer cannot be built, found or read; the message names the file or task."""


@dataclass(frozen=True)
class Layer:
    digest: str  # sha256 of the compressed blob
    diff_id: str  # sha256 of the uncompressed tar
    compression: str
    size_bytes: int  # compressed
    tar_bytes: int  # uncompressed


@dataclass(frozen=True)
class Image:
    name: str
    layers: tuple[Layer, ...]  # base first
    workdir: str = WORKDIR
    # host toolchains its sandboxes get besides /usr (sandboxes.toolchain.HOST_TOOLCHAINS): declared
    # here, so a tool the image lacks is never taken from the host unnoticed
    toolchains: tuple[str, ...] = ()

    @property
    def size_bytes(self) -> int:
        return sum(layer.size_bytes for layer in self.layers)

    def to_json(self) -> dict:
        data = {"name": self.name, "workdir": self.workdir, "layers": [asdict(l) for l in self.layers]}
        return {**data, "toolchains": list(self.toolchains)} if self.toolchains else data

    @classmethod
    def from_json(cls, obj: dict, source: str = "<manifest>") -> "Image":
        try:
            layers = tuple(Layer(**l) for l in obj["layers"])
            return cls(name=obj["name"], layers=layers, workdir=obj.get("workdir", WORKDIR),
                       toolchains=tuple(obj.get("toolchains", ())))
        except (KeyError, TypeError) as exc:
            raise ImageError(f"{source}: malformed image manifest ({exc}); expected name, layers[digest, diff_id, "
                             f"compression, size_bytes, tar_bytes]") from None


# ---------------------------------------------------------------------------------------------
# building tars


def _tarinfo(name: str, st: os.stat_result | None = None, *, kind=tarfile.REGTYPE, mode=0o755,
             owner: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    # no setuid/setgid bits in images: nothing in a sandbox may gain rights by running a file
    info.mode = (stat.S_IMODE(st.st_mode) & 0o1777) if st is not None else mode
    info.mtime = 0  # content addressing: the same files give the same digest
    info.uid = info.gid = owner
    info.uname = info.gname = ""
    return info


def tar_directory(src: Path, prefix: str, owner: int = SANDBOX_UID) -> bytes:
    """A deterministic tar of ``src`` placed under ``prefix`` (sorted names, zeroed times, every
    entry owned by ``owner``: by default the sandbox user, whose workspace it becomes).

    Regular files, folders and symlinks are kept; sockets, devices and fifos are refused."""
    src = Path(src)
    if not src.is_dir():
        raise ImageError(f"{src}: not a folder")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(_tarinfo(prefix, kind=tarfile.DIRTYPE, mode=0o755, owner=owner))
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, src)
            for name in sorted(dirnames + filenames):
                path = os.path.join(dirpath, name)
                arc = os.path.normpath(os.path.join(prefix, rel_dir, name))
                st = os.lstat(path)
                if stat.S_ISDIR(st.st_mode):
                    tar.addfile(_tarinfo(arc, st, kind=tarfile.DIRTYPE, owner=owner))
                elif stat.S_ISLNK(st.st_mode):
                    info = _tarinfo(arc, st, kind=tarfile.SYMTYPE, owner=owner)
                    info.linkname = os.readlink(path)
                    tar.addfile(info)
                elif stat.S_ISREG(st.st_mode):
                    info = _tarinfo(arc, st, owner=owner)
                    info.size = st.st_size
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
                else:
                    raise ImageError(f"{path}: not a regular file, folder or symlink; images cannot hold it")
    return buf.getvalue()


BASE_FILES = {
    "etc/passwd": f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:/home/sandbox:/bin/bash\n"
                  "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "etc/group": f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n",
    "etc/hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
    "etc/hostname": "sandbox\n",
    "etc/nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
    "etc/gitconfig": "[user]\n\tname = posttrain\n\temail = posttrain@localhost\n[safe]\n\tdirectory = *\n"
                     "[init]\n\tdefaultBranch = main\n[core]\n\tpager = cat\n",
}
BASE_DIRS = ("etc", "tmp", "proc", "dev", "sys", "run", "usr", "opt", "opt/pxd", "home", "home/sandbox", "root",
             "workspace")
BASE_LINKS = {"bin": "usr/bin", "lib": "usr/lib", "lib64": "usr/lib64", "sbin": "usr/sbin"}


PXD_SOURCE = Path(__file__).with_name("pxd.py")


def base_layer_tar() -> bytes:
    """The skeleton root every image starts from (see the module docstring), with the daemon at
    ``/opt/pxd/pxd.py`` so a cluster pod built from the layers can start it (locally the runtimes
    write the current pxd, compiled, at ``/opt/pxd/pxd.pyc``); that file is pxd as shipped
    (:func:`sandboxes.programs.shipped_source`), which imports nothing of the project."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        entries = [(d, "dir") for d in BASE_DIRS] + [(n, "link") for n in BASE_LINKS] + [(f, "file") for f in BASE_FILES]
        for name, kind in sorted(entries):
            if kind == "dir":
                info = _tarinfo(name, kind=tarfile.DIRTYPE, mode=0o1777 if name == "tmp" else 0o755,
                                owner=SANDBOX_UID if name in ("workspace", "home/sandbox") else 0)
                tar.addfile(info)
            elif kind == "link":
                info = _tarinfo(name, kind=tarfile.SYMTYPE, mode=0o777)
                info.linkname = BASE_LINKS[name]
                tar.addfile(info)
            else:
                data = BASE_FILES[name].encode()
                info = _tarinfo(name, mode=0o644)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        data = shipped_source(PXD_SOURCE)  # one file: standalone.py's text written into it
        info = _tarinfo("opt/pxd/pxd.py", mode=0o644)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# compression


def compress(data: bytes, compression: str, level: int | None = None) -> bytes:
    if compression == "zstd":
        return zstandard.ZstdCompressor(level=3 if level is None else level, threads=-1 if len(data) > 1 << 22 else 0).compress(data)
    if compression == "gzip":
        return gzip.compress(data, compresslevel=6 if level is None else level, mtime=0)
    raise ImageError(f"compression {compression!r} is not one of {', '.join(COMPRESSIONS)}")


def decompressed_chunks(path: Path, compression: str, chunk: int = 1 << 20):
    """Yield the uncompressed tar of a blob in chunks (streaming: a layer never sits whole in memory)."""
    with open(path, "rb") as f:
        if compression == "zstd":
            reader = zstandard.ZstdDecompressor().stream_reader(f, read_size=chunk)
            while data := reader.read(chunk):
                yield data
        elif compression == "gzip":
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            while raw := f.read(chunk):
                yield d.decompress(raw)
            yield d.flush()
        else:
            raise ImageError(f"{path}: compression {compression!r} is not one of {', '.join(COMPRESSIONS)}")


def unpack_layer(blob: Path, compression: str, dest: Path) -> None:
    """Unpack a compressed layer into ``dest``: Python decompresses, GNU tar extracts, in a pipe.

    GNU tar refuses member names with ``..`` and strips leading ``/``; symlinks are created after
    the files (so no member can be written through one)."""
    dest.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        ["tar", "-x", "-f", "-", "-C", str(dest), "--same-permissions", "--same-owner", "--delay-directory-restore"],
        stdin=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    errors: list[BaseException] = []

    def pump():
        try:
            for data in decompressed_chunks(blob, compression):
                proc.stdin.write(data)
        except BaseException as exc:  # noqa: BLE001 - reported below with the file name
            errors.append(exc)
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass

    # the decompressor and tar run at the same time
    t = threading.Thread(target=pump, daemon=True)
    t.start()
    stderr = proc.stderr.read()
    proc.wait()
    t.join()
    if errors and not isinstance(errors[0], BrokenPipeError):
        raise ImageError(f"{blob}: cannot decompress layer ({errors[0]})")
    if proc.returncode != 0:
        raise ImageError(f"{blob}: tar failed to unpack the layer: {stderr.decode(errors='replace').strip()}")


# ---------------------------------------------------------------------------------------------
# the store


class ImageStore:
    """Layers (by digest) and image manifests (by name) in one folder; writes are atomic."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        (self.root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (self.root / "images").mkdir(parents=True, exist_ok=True)

    def blob_path(self, layer: Layer) -> Path:
        return self.root / "blobs" / "sha256" / (layer.digest.split(":", 1)[1] + SUFFIX[layer.compression])

    def put_layer(self, tar_bytes: bytes, compression: str = "zstd", level: int | None = None) -> Layer:
        diff_id = "sha256:" + hashlib.sha256(tar_bytes).hexdigest()
        index = self.root / "blobs" / "by-diff-id" / compression / diff_id.split(":", 1)[1]
        if index.exists():  # built before: reuse the blob, skip compressing again
            layer = Layer(**json.loads(index.read_text()))
            if self.blob_path(layer).exists():
                return layer
        blob = compress(tar_bytes, compression, level)
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        layer = Layer(digest=digest, diff_id=diff_id, compression=compression, size_bytes=len(blob),
                      tar_bytes=len(tar_bytes))
        _atomic_write(self.blob_path(layer), blob)
        index.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(index, json.dumps(asdict(layer)).encode())
        return layer

    def save_image(self, image: Image) -> Path:
        path = self.root / "images" / f"{image.name}.json"
        _atomic_write(path, json.dumps(image.to_json(), indent=1).encode())
        return path

    def load_image(self, name: str) -> Image:
        path = self.root / "images" / f"{name}.json"
        if not path.exists():
            known = ", ".join(sorted(self.image_names())[:20]) or "none"
            raise ImageError(f"no image {name!r} in {self.root / 'images'} (images there: {known})")
        try:
            obj = json.loads(path.read_text())
        except ValueError as exc:
            raise ImageError(f"{path}: not JSON ({exc})") from None
        image = Image.from_json(obj, str(path))
        for layer in image.layers:
            if not self.blob_path(layer).exists():
                raise ImageError(f"{path}: layer {layer.digest} is missing from {self.blob_path(layer).parent}")
        return image

    def image_names(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "images").glob("*.json"))

    def base_layer(self, compression: str = "zstd") -> Layer:
        return self.put_layer(base_layer_tar(), compression)


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def image_name(task_id: str) -> str:
    """The image name of a task: the id itself when it is a valid name, else a readable part and a hash."""
    if NAME_RE.match(task_id):
        return task_id
    clean = re.sub(r"[^A-Za-z0-9._-]+", "-", task_id).strip("-._")[:100] or "task"
    return f"{clean}-{hashlib.sha256(task_id.encode()).hexdigest()[:12]}"


def build_image(name: str, repo_dir: Path | str, store: ImageStore, compression: str = "zstd",
                toolchains: tuple[str, ...] = ()) -> Image:
    """Build (or find, layers being content addressed) the image of one task repository; its
    sandboxes get the host ``toolchains`` it declares (:data:`sandboxes.toolchain.HOST_TOOLCHAINS`)."""
    if not NAME_RE.match(name):
        raise ImageError(f"image name {name!r}: use letters, digits, '.', '_' or '-' (at most 128)")
    repo_dir = Path(repo_dir)
    if not repo_dir.is_dir():
        raise ImageError(f"task {name}: repository folder {repo_dir} does not exist")
    task_layer = store.put_layer(tar_directory(repo_dir, WORKDIR.lstrip("/")), compression)
    image = Image(name=name, layers=(store.base_layer(compression), task_layer), toolchains=tuple(toolchains))
    store.save_image(image)
    return image


@dataclass(frozen=True)
class BuildReport:
    images: list[Image]
    failures: dict[str, str]  # task name -> why its image could not be built
    store_bytes: int  # compressed bytes of every distinct layer
    tar_bytes: int  # uncompressed bytes of every distinct layer

    def to_json(self) -> dict:
        return {"images": len(self.images), "failures": self.failures, "store_bytes": self.store_bytes,
                "tar_bytes": self.tar_bytes,
                "per_image": {i.name: {"size_bytes": i.size_bytes, "layers": [l.digest for l in i.layers]}
                              for i in self.images}}


def build_images(repos: Mapping[str, Path | str] | Iterable[tuple[str, Path | str]], store: ImageStore,
                 compression: str = "zstd") -> BuildReport:
    """Build the image of every task; a task that fails is reported in ``failures``, never dropped."""
    items = repos.items() if isinstance(repos, Mapping) else repos
    images, failures = [], {}
    for name, path in items:
        try:
            images.append(build_image(name, path, store, compression))
        except (ImageError, OSError) as exc:
            failures[name] = str(exc)
    distinct = {l.digest: l for i in images for l in i.layers}
    return BuildReport(images=images, failures=failures,
                       store_bytes=sum(l.size_bytes for l in distinct.values()),
                       tar_bytes=sum(l.tar_bytes for l in distinct.values()))
