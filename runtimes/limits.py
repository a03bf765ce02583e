"""Every resource bound the runtime and the CLI enforce, in one place (docs/hardening.md).

A bundle may come from an untrusted source, so nothing it says is allowed to size an
allocation, a loop or a read before it has been checked against these bounds. Each bound
is far above what a real model needs (SmolLM2: 30 layers, hidden 576, vocab 49152,
max_len 2048; Llama-3-70B: 80 layers, hidden 8192, vocab 128256) and far below what would
exhaust a device.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from adaptive_export.runtimes.errors import UsageError

# ---- model dimensions (manifest "model" and "max_len") ------------------------------
MAX_LEN = 1 << 16  # KV arena length; the exporter traces T and P up to 2**16 (exporter/onnx_export.MAX_DIM)
MAX_LAYERS = 1024
MAX_HIDDEN = 1 << 16
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_INTERMEDIATE = 1 << 18
MAX_VOCAB = 1 << 21  # 2M tokens; the largest released vocabularies are ~260k

# ---- memory ---------------------------------------------------------------------------
ARENA_MAX_BYTES = 64 << 30  # the KV arena, whatever the machine
ARENA_MAX_SHARE_OF_AVAILABLE = 0.8  # ... and at most this share of MemAvailable at load time

# ---- engine runs (runtimes/backends/run_guard.py) -----------------------------------------
ENGINE_MEMORY_MARGIN = 256 << 20  # ONNX Runtime's arena ceiling: 2x weights + KV arena + activations + this
ACTIVATION_FACTOR = 4  # ... activations: this many fp32 copies of the widest activation at T = max_len
RUN_TIME_FLOOR_S = 5.0  # no engine run is stopped sooner (a tiny model's runs take milliseconds)
RUN_TIME_FACTOR = 50  # a session's later runs: at most this many times its first run (per token, scaled up)
WORST_CASE_FLOPS = 1e9  # a session's first run: its FLOPs at this rate (2-core EPYC: about 100x faster)
WATCH_TICK_S = 0.2  # the watchdog checks deadlines this often (and wakes at once on a signal)

# ---- manifest and bundle structure ----------------------------------------------------
MAX_MANIFEST_BYTES = 16 << 20
MAX_FILES = 4096  # entries in manifest "files"
MAX_GRAPHS = 1024
MAX_CONFIGS = 256
MAX_TENSORS = 1 << 16
MAX_PATH_CHARS = 1024
MAX_CHAT_AFFIX_CHARS = 64 << 10  # tokenizer.chat prefix / suffix (the template is pre-rendered, never executed)
MAX_ENGINE_BYTES = 1 << 30  # one .onnx engine (weights live in weights.bin; protobuf cannot exceed 2 GB anyway)
MAX_TOKENIZER_BYTES = 256 << 20
MAX_CALIBRATION_BYTES = 64 << 20
# a bundle's file sizes, checked before anything is hashed (runtimes/file_bounds.py)
WEIGHTS_SIZE_FACTOR = 4  # the weights file: at most this many times the fp32 bytes the dimensions imply ...
WEIGHTS_SIZE_SLACK = 64 << 20  # ... plus this (routers, exit adapters, prompt tokens, draft heads of a tiny model)
SPARSE_MIN_BYTES = 1 << 20  # files this large must be allocated on disk ...
SPARSE_MAX_RATIO = 4  # ... at least to a quarter of their size (compressed filesystems still pass)

# ---- run-time arguments -----------------------------------------------------------------
MAX_THREADS_PER_CORE = 4
MAX_THREADS_CAP = 256
MAX_DRAFT_LEN = 64
MAX_PROMPT_FILE_BYTES = 4 << 20
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024

# ---- build ------------------------------------------------------------------------------
MAX_BUILD_LEN = MAX_LEN


def max_threads() -> int:
    return max(1, min(MAX_THREADS_CAP, MAX_THREADS_PER_CORE * (os.cpu_count() or 1)))


def check_threads(threads: object) -> int:
    """0 means the backend's default; otherwise 1..4x the cores (64 threads took 22 s to start on 2 cores)."""
    if not isinstance(threads, int) or isinstance(threads, bool) or not 0 <= threads <= max_threads():
        raise UsageError(
            f"--threads {threads!r} is outside 0..{max_threads()} (4 per core on this machine)",
            "pass 0 for the default (one per physical core) or a count up to 4 per core",
        )
    return threads


def check_draft_len(draft_len: object) -> int | None:
    if draft_len is None:
        return None
    if not isinstance(draft_len, int) or isinstance(draft_len, bool) or not 1 <= draft_len <= MAX_DRAFT_LEN:
        raise UsageError(f"draft length {draft_len!r} is outside 1..{MAX_DRAFT_LEN}", "use a draft length such as 4")
    return draft_len


def check_decode_rows(rows: object) -> int:
    """Rows every decode pass runs: 1 (plain T=1 steps) or 2 (floor rounds, runtimes/speculative.py)."""
    if not isinstance(rows, int) or isinstance(rows, bool) or rows not in (1, 2):
        raise UsageError(f"decode rows {rows!r} is not 1 or 2", "pass decode_rows=1, 2, or None for the bundle's")
    return rows


def available_memory() -> int | None:
    """The bytes this process may still use (None where unknown): the least of the machine's
    MemAvailable, what the cgroup's memory.max leaves, and the soft RLIMIT_DATA / RLIMIT_AS
    (a container or `ulimit` kills or refuses before the machine runs out)."""
    known = [b for b in (_meminfo_available(), _cgroup_headroom(), _rlimit_bytes()) if b is not None]
    return min(known) if known else None


SKIP_MEMORY_CHECK_VARIABLE = "ADAPTIVE_EXPORT_SKIP_MEMORY_CHECK"  # "1": start work the estimate refuses


def machine_memory() -> int | None:
    """The bytes the machine (and this process's cgroup) can still give, without the process's own
    soft rlimits: what an upper bound such as the engines' arena ceiling is compared with (an
    address-space limit counts mappings, not memory)."""
    known = [b for b in (_meminfo_available(), _cgroup_headroom()) if b is not None]
    return min(known) if known else None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _cgroup_headroom() -> int | None:
    """cgroup v2 memory.max minus memory.current of this process's group ('max': no limit)."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as handle:
            group = next((line.strip().split("::", 1)[1] for line in handle if line.startswith("0::")), None)
        if group is None:
            return None
        folder = Path("/sys/fs/cgroup") / group.lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((folder / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def _rlimit_bytes() -> int | None:
    """The soft data / address-space limit of this process (`ulimit -d` / `-v`)."""
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    limits = [resource.getrlimit(kind)[0] for kind in (resource.RLIMIT_DATA, resource.RLIMIT_AS)]
    finite = [limit for limit in limits if limit != resource.RLIM_INFINITY]
    return min(finite) if finite else None


def check_arena_bytes(nbytes: int) -> None:
    """Refuse a KV arena the machine cannot hold, before allocating it."""
    limit = ARENA_MAX_BYTES
    available = available_memory()
    if available is not None:
        limit = min(limit, int(available * ARENA_MAX_SHARE_OF_AVAILABLE))
    if nbytes > limit:
        raise UsageError(
            f"the bundle's KV arena needs {nbytes / 2**30:.2f} GiB, more than the {limit / 2**30:.2f} GiB allowed here",
            "rebuild the bundle with a smaller --max-len, or run it on a machine with more memory",
        )


def open_regular(path: Path, what: str) -> int:
    """Open a file for reading without following a final symlink or blocking on a FIFO/device;
    refuse anything that is not a regular file. Returns the file descriptor."""
    try:
        fd = os.open(
            path,
            os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0),
        )
    except FileNotFoundError:
        raise UsageError(f"{what} {str(path)!r} does not exist", "pass an existing regular file") from None
    except OSError as exc:
        raise UsageError(
            f"cannot open {what} {str(path)!r}: {exc.strerror or exc} (symlinks, FIFOs and devices are refused)",
            "pass a regular file",
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(
            f"{what} {str(path)!r} is not a regular file",
            "pass a regular file (not a directory, FIFO, device or socket)",
        )
    return fd


def read_regular(path: Path, what: str, max_bytes: int) -> bytes:
    """Read a whole regular file of at most max_bytes (a larger one is refused, never read)."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise UsageError(
                f"{what} {str(path)!r} has {size} bytes, more than the {max_bytes} allowed", "pass a smaller file"
            )
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 22, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:  # grew while reading
                raise UsageError(
                    f"{what} {str(path)!r} is larger than the {max_bytes} bytes allowed", "pass a smaller file"
                )
        return b"".join(chunks)
    except OSError as exc:
        raise UsageError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}", "check the file") from None
    finally:
        os.close(fd)


# ---- tokenizer.json (runtimes/tokenizer_policy.py; SmolLM2 and Gemma 3 in parentheses) ---------
MAX_TOKENIZER_JSON_BYTES = 64 << 20  # parsed with the json module before tokenizers sees it (Gemma 3: 33 MB)
MAX_TOKENIZER_JSON_ITEMS = 1 << 22  # commas in the file, counted before parsing (Gemma 3: 1.34 M)
TOKENIZER_ITEMS_PER_TOKEN = 16  # ... and at most this many per token of the model's vocabulary, plus 64 K
MAX_TOKENIZER_STEPS = 16  # nodes of one normalizer / pre-tokenizer / post-processor / decoder tree (Gemma 3: 4)
MAX_TOKENIZER_NESTING = 4  # Sequence inside Sequence
MAX_TOKEN_CHARS = 256  # one vocabulary entry, merge part or added token (SmolLM2: 81, Gemma 3: 31)
MAX_ADDED_TOKENS = 1 << 16  # (SmolLM2: 17, Gemma 3: 6,384)
MAX_MERGES_PER_TOKEN = 4  # BPE merges per vocabulary entry (Gemma 3: 514,906 for 262,144, so 1.96)
MAX_TOKENIZER_PATTERN_CHARS = 1024  # a Replace / Split pattern, string or regex
MAX_TOKENIZER_AFFIX_CHARS = 64  # Replace content, Prepend, prefixes, suffixes, replacement characters
MAX_TEXT_GROWTH = 4  # how many times a normalizer or decoder chain may lengthen text (Gemma 3: 1)
MAX_PRECOMPILED_CHARSMAP_CHARS = 4 << 20  # base64 text of a Precompiled normalizer (SentencePiece's: ~0.4 MB)
MAX_WORDPIECE_WORD_CHARS = 256  # WordPiece max_input_chars_per_word (BERT: 100); its matching is quadratic
MAX_TEMPLATE_PIECES = 64  # pieces and special tokens of a post-processor template
MAX_PAD_MULTIPLE = 64  # padding.pad_to_multiple_of (the runtime encodes one prompt; Fixed padding is refused)
