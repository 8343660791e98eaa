"""The ``moeq`` command line.

Every command reports bad input as one line ``moeq: error: ...`` on stderr and exits 1; it never
prints a Python traceback (set ``MOEQ_DEBUG=1`` to see one for an internal error).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from ._args import I64_MAX
from .errors import MoeqError

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        # argparse's own ignores a failed write, so `moeq --help > /dev/full` exited 0 with
        # nothing written; here the OSError reaches main.
        if message:
            out = file if file is not None else sys.stderr
            out.write(message)
            flush = getattr(out, "flush", None)
            if flush is not None:
                flush()

    def error(self, message: str) -> NoReturn:
        # One line, like every other moeq error; `moeq -h` shows the usage.
        _fail(
            f"{message} (see 'moeq {self.prog.split(' ', 1)[-1]} -h')"
            if " " in self.prog
            else f"{message} (see 'moeq -h')"
        )


def _fail(message: str) -> NoReturn:
    _to_stderr(f"moeq: error: {_one_line(message)}")
    raise SystemExit(1)


def _one_line(message: object) -> str:
    return " ".join(str(message).split("\n")).strip()


def _to_stderr(text: str, end: str = "\n") -> bool:
    """``text`` on stderr, if there is one: with stderr closed (``2>&-``) ``print(file=None)``
    would write to stdout, which may be a JSON pipe; a stderr that fails is given up on.
    Whether it was written."""
    if sys.stderr is None:
        return False
    try:
        print(text, end=end, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        return False
    return True


def _warn(message: str) -> None:
    """One ``moeq: warning: ...`` line on stderr, if there is one to write to."""
    _to_stderr(f"moeq: warning: {_one_line(message)}")


def _fmt_activation(act: dict[str, Any] | None) -> str:
    if act is None:
        return "-"
    kind = "dynamic" if act["dynamic"] else "static"
    return f"{act['type']}{act['num_bits']} {act['strategy']} {kind}"


def _cell(values: list[str]) -> str:
    uniq: list[str] = []
    for v in values:
        if v not in uniq:
            uniq.append(v)
    return "/".join(uniq)


def _layer_row(layer: dict[str, Any]) -> list[str]:
    if layer["weight"] is not None or not layer.get("mixed"):
        projections = [layer]
    else:
        projections = [p for e in layer["experts"] for p in e["projections"].values()]
    bits, group, sym, act, fmt = [], [], [], [], []
    for p in projections:
        w = p["weight"]
        if w is None:
            bits.append("16")
            group.append("-")
            sym.append("-")
        else:
            bits.append(str(w["num_bits"]))
            g = str(w["group_size"]) if w["strategy"] == "group" else w["strategy"]
            if w["actorder"] == "group":
                g += " act-order"
            group.append(g)
            sym.append("yes" if w["symmetric"] else "no")
        act.append(_fmt_activation(p["activation"]))
        fmt.append(p["format"] or "-")
    experts = str(layer["num_experts"])
    if layer.get("shared_experts"):
        experts += "+shared"
    return [
        str(layer["layer"]),
        experts,
        _cell(bits),
        _cell(group),
        _cell(sym),
        _cell(act),
        _cell(fmt) + (" (per-expert mix)" if layer.get("mixed") else ""),
    ]


def _print_table(summary: dict[str, Any], compat: bool) -> None:
    r = summary["routing"]
    print(f"model:    {summary['model_dir']}")
    print(
        f"quant:    {summary['quant_method'] or 'none'}"
        f" (format {summary['format'] or '-'}, version {summary.get('version') or '-'})"
    )
    if summary.get("layout", "compressed-tensors") != "compressed-tensors":
        print(f"layout:   {summary['layout']} (written by moeq repack)")
    scaling = r["routed_scaling_factor"]
    groups = f", groups {r['topk_group']}/{r['n_group']}" if r["n_group"] else ""
    cap = r.get("logit_softcapping")
    softcap = f", logits softcapped at {cap}" if cap else ""
    if r["top_k"] is None:
        print("routing:  - (no MoE layers)")
    else:
        print(
            f"routing:  {r['scoring_func']} top-{r['top_k']}"
            f"{' renormalised' if r['renormalize'] else ''}{groups}"
            f"{f', scaled x{scaling}' if scaling != 1.0 else ''}"
            f"{softcap}"
            f"{'' if r.get('family_checked', True) else ' (model family not checked: see README)'}"
        )
    if r.get("family_defaults"):
        print(f"          (the family's defaults for {', '.join(r['family_defaults'])})")
    if summary["dense_layers"]:
        print(f"dense:    layers {', '.join(map(str, summary['dense_layers']))}")
    if summary.get("set_aside_moe"):
        print(
            f"set aside: {', '.join(summary['set_aside_moe'])}"
            " (MoE blocks outside the model's stack of layers; not loaded)"
        )
    plat = summary["platform"]
    where = (
        f"cuda sm {plat['sm']}"
        if plat["name"] == "cuda"
        else ("cpu (" + (", ".join(plat["cpu_features"]) or "scalar") + ")")
    )
    extra = (
        f", backend {summary['requested_backend']} requested"
        if summary.get("requested_backend")
        else ""
    )
    tp = f", tp {summary['tp_size']}" if summary.get("tp_size", 1) != 1 else ""
    print(f"platform: {where}{tp}{extra}")
    header = [
        "layer",
        "experts",
        "bits",
        "group",
        "symmetric",
        "activation",
        "format",
        "method",
        "backend",
    ]
    if compat:
        header += ["vllm"]
    rows = [header]
    for layer in summary["moe_layers"]:
        row = _layer_row(layer) + [layer["method"], layer["backend"] or "-"]
        if compat:
            v = layer["vllm"]
            row.append("error" if v["error"] else f"{v['method'] or '-'} / {v['backend'] or '-'}")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for i, row in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if not summary["moe_layers"]:
        print("(no MoE layers found)")
    for layer in summary["moe_layers"]:
        if layer["error"]:
            print(f"layer {layer['layer']}: {layer['error']}")
        if compat and layer["vllm"]["error"]:
            print(
                f"layer {layer['layer']}: vLLM {summary['vllm_snapshot']}: {layer['vllm']['error']}"
            )
        if compat:
            for note in layer["vllm"]["notes"]:
                print(f"layer {layer['layer']}: vLLM: {note}")
    for m in summary.get("config_layer_mismatch", []):
        print(f"warning: layer {m['layer']}: {m['reason']}")
    if compat and summary["vllm_regressions"]:
        print("known vLLM regressions that concern this checkpoint:")
        for reg in summary["vllm_regressions"]:
            layers = ", ".join(map(str, reg["layers"]))
            print(f"  - [{reg['prs']}] {reg['summary']} (layers {layers})")


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .checkpoint import open as open_checkpoint
    from .oracle import plan

    if args.sm is not None and args.platform != "cuda":
        _fail("--sm needs --platform cuda")
    ckpt = open_checkpoint(args.model_dir)
    summary = plan(
        ckpt, args.platform, args.sm, backend=args.backend, tp_size=args.tp_size, compat=args.compat
    )
    if sys.stdout is None:
        # Started with stdout closed (`>&-`): print() would write nothing and succeed.
        _fail("cannot write to stdout: it is closed")
    try:
        if args.json:
            json.dump(summary, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            _print_table(summary, compat=args.compat == "vllm")
        sys.stdout.flush()
    except BrokenPipeError:
        raise  # main's quiet exit for a reader that went away
    except OSError as err:
        # Redirected to the file /dev/full, say: name stdout, not only the errno (and point
        # stdout at /dev/null, so that its flush at exit cannot fail again).
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        _fail(f"cannot write to stdout: {err.strerror or err}")
    return 0


class _ProgressBar:
    """A one-line progress bar on stderr: redrawn in place on a terminal, a line per 10% else."""

    def __init__(self) -> None:
        import time

        self._t0 = time.perf_counter()
        # No stderr (closed: `2>&-`) or one that fails: the repack goes on without a bar.
        self._on = sys.stderr is not None
        try:
            self._tty = self._on and sys.stderr.isatty()
        except (OSError, ValueError):
            self._tty = False
        self._last_decile = -1

    def _print(self, text: str, end: str = "\n") -> None:
        # A progress line is not worth failing the repack for (stderr on a full disk): after
        # one that cannot be written, the bar stays off.
        self._on = self._on and _to_stderr(text, end)

    def __call__(self, stage: str, done: int, total: int, written: int, wtotal: int) -> None:
        import time

        secs = max(time.perf_counter() - self._t0, 1e-9)
        frac = written / wtotal if wtotal else 1.0
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        line = (
            f"repack [{bar}] {stage:6} {done}/{total}  {written / 1e6:9.1f} / "
            f"{wtotal / 1e6:.1f} MB  {written / 1e6 / secs:7.1f} MB/s"
        )
        if self._tty:
            self._print("\r" + line, end="")
        elif int(frac * 10) != self._last_decile:
            self._last_decile = int(frac * 10)
            self._print(line)

    def close(self) -> None:
        if self._tty:
            self._print("")


def _identity(path: str) -> tuple[int, int] | None:
    """Which directory entry ``path`` names now (device and inode), or None if none."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _cmd_repack(args: argparse.Namespace) -> int:
    from .checkpoint import open as open_checkpoint
    from .repack import parse_size, repack_checkpoint

    size = parse_size(args.max_shard_size)
    ckpt = open_checkpoint(args.model_dir)
    bar = _ProgressBar()
    # Whether OUT_DIR is now the repack's output: the repack checks for Ctrl-C (or SIGTERM,
    # SIGHUP) up to the rename that commits it, but a signal may land during the rename or any
    # time after it, and then "nothing was written" would be false (see main). The finished
    # directory, `.<name>.moeq-tmp-<pid>` beside OUT_DIR, is noted as the commit starts; OUT_DIR
    # is ours once it is that directory (not merely something other than before: another
    # process may have put something there).
    out = Path(args.out_dir)
    finished = out.parent / f".{out.name}.moeq-tmp-{os.getpid()}"
    staged: list[tuple[int, int] | None] = [None]

    def progress(stage: str, done: int, total: int, written: int, wtotal: int) -> None:
        if stage == "commit":
            staged[0] = _identity(str(finished))
        bar(stage, done, total, written, wtotal)

    args.committed = lambda: staged[0] is not None and _identity(args.out_dir) == staged[0]
    try:
        r = repack_checkpoint(
            ckpt,
            args.out_dir,
            target=args.target,
            force=args.force,
            max_shard_size=size,
            verify=args.verify,
            progress=progress,
        )
    finally:
        bar.close()
    # Before the summary, which may fail to print (the output is complete either way).
    if r["leftover"]:
        _warn(f"{args.out_dir} is written and complete, but {r['leftover']}")
    rate = r["bytes_written"] / 1e6 / max(r["seconds"], 1e-9)
    verified = (
        f"; verified {r['verified_modules']} expert projections bit for bit" if args.verify else ""
    )
    try:
        print(
            f"wrote {r['out_dir']}: {r['layers']} MoE layers, {r['tensors']} tensors, "
            f"{r['bytes_written'] / 1e6:.1f} MB in {r['seconds']:.2f} s ({rate:.1f} MB/s)"
            f"{verified}",
            flush=True,
        )
    except BrokenPipeError:
        raise
    except OSError as err:
        # The output is committed: the error is the summary line's alone.
        _fail(
            f"{args.out_dir} is written and complete, but its summary could not be printed: "
            f"{err.strerror or err}"
        )
    return 0


def _compute_capability(text: str) -> int:
    # As plan() checks it, but argparse names the flag: "argument --sm: ...".
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 10 <= value <= 199:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a compute capability (major*10 + minor, 10 to 199: 90 for sm_90)"
        )
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    # argparse names the flag: "argument --tp-size: ..."
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    if value > I64_MAX:
        raise argparse.ArgumentTypeError(f"{text!r} is too large (at most {I64_MAX})")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moeq", description="Inspect and prepare quantized MoE checkpoints.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"moeq_rs {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    p = sub.add_parser(
        "inspect",
        help="one row per MoE layer: experts, bits, group, symmetric, activation, format",
    )
    p.add_argument(
        "model_dir", metavar="MODEL_DIR", help="checkpoint directory (config.json + safetensors)"
    )
    p.add_argument("--json", action="store_true", help="write one JSON document to stdout")
    p.add_argument(
        "--platform",
        choices=["cpu", "cuda"],
        default="cpu",
        help="plan for this platform (default: cpu, this machine's features)",
    )
    p.add_argument(
        "--sm",
        type=_compute_capability,
        default=None,
        metavar="N",
        help="CUDA compute capability as major*10+minor, e.g. 90 (default 90)",
    )
    p.add_argument(
        "--backend",
        choices=["cpu_simd", "cuda_marlin_wna16", "cuda_int8_w8a8"],
        help="require this backend (layers it cannot run report why)",
    )
    p.add_argument(
        "--tp-size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="tensor-parallel size the plan assumes (default 1)",
    )
    p.add_argument(
        "--compat",
        choices=["vllm"],
        help="also report what vLLM (main @7cfb97e33791) would do per layer",
    )
    p.set_defaults(func=_cmd_inspect)
    rp = sub.add_parser("repack", help="write the checkpoint in a kernel layout (Marlin or CPU)")
    rp.add_argument("model_dir", metavar="MODEL_DIR", help="source checkpoint directory")
    rp.add_argument("out_dir", metavar="OUT_DIR", help="new directory to create")
    rp.add_argument(
        "--target",
        choices=["marlin", "cpu"],
        required=True,
        help=(
            "layout to write (marlin: vLLM's fused-MoE Marlin tensors; cpu: moeq_rs's "
            "prepacked CPU blocks, which MoELayer.from_checkpoint loads without packing)"
        ),
    )
    rp.add_argument(
        "--verify",
        action="store_true",
        help="dequantize the output and compare it with the source, bit for bit",
    )
    rp.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    rp.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest shard file (default 5GB; e.g. 500MB, 2GiB)",
    )
    rp.set_defaults(func=_cmd_repack)
    return parser


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (`timeout`, `docker stop`, a closed terminal), raised where Ctrl-C
    would be, so that a repack stops the same way: nothing left behind."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupted_status(e: KeyboardInterrupt) -> int:
    """The exit status of a command stopped by `e`: 128 + the signal, as shells report it."""
    return 128 + e.signum if isinstance(e, _Terminated) else 128 + signal.SIGINT


def _raise_terminated(signum: int, _frame: object) -> None:
    raise _Terminated(signum)


def _prepare_process() -> Callable[[], None]:
    """Sets the process up for a command; returns what undoes the signal handlers (for
    callers of :func:`main` in a process that goes on)."""
    # Paths a terminal's encoding cannot show are escaped rather than failing the command
    # after its work is done.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    previous: list[tuple[int, Any]] = []
    if threading.current_thread() is threading.main_thread():
        for name in ("SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:
                previous.append((sig, signal.signal(sig, _raise_terminated)))

    def restore() -> None:
        for sig, handler in previous:
            signal.signal(sig, handler)

    return restore


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as err:
        # --help or --version could not write their text (a full disk, say).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        _fail(f"cannot write to stdout: {err.strerror or err}")
    restore = _prepare_process()
    try:
        return int(args.func(args))
    except MoeqError as e:
        _fail(str(e))
    except BrokenPipeError:
        # The reader went away (`moeq inspect ... | head`): stop quietly, as Unix tools do, with
        # SIGPIPE's status; stdout goes to /dev/null so that flushing it at exit cannot fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except OSError as e:
        _fail(f"{e.filename or ''}: {e.strerror or e}".lstrip(": "))
    except KeyboardInterrupt as e:
        committed = getattr(args, "committed", None)
        if committed is not None and committed():
            _to_stderr(
                f"\nmoeq: interrupted as the repack finished; {args.out_dir} is written and "
                "complete"
            )
        else:
            # A temporary directory that could not be removed rides on the exception as a
            # note (PEP 678), added by the repack.
            also = "".join(f"; but {note}" for note in getattr(e, "__notes__", ()))
            _to_stderr(f"\nmoeq: interrupted; nothing was written{also}")
        return _interrupted_status(e)
    except Exception as e:  # noqa: BLE001 - the CLI must never print a traceback
        if os.environ.get("MOEQ_DEBUG"):
            raise
        _fail(f"internal error: {type(e).__name__}: {e} (set MOEQ_DEBUG=1 for a traceback)")
    except BaseException as e:
        # A Rust panic reaches Python as pyo3's PanicException, a BaseException (so that
        # `except Exception` does not swallow it); here it is a bug to report, in one line.
        if type(e).__name__ != "PanicException" or os.environ.get("MOEQ_DEBUG"):
            raise
        _fail(
            f"internal error (a bug in moeq_rs): Rust panic: {e} (set MOEQ_DEBUG=1 for a traceback)"
        )
    finally:
        restore()


if __name__ == "__main__":
    sys.exit(main())
