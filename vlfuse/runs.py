"""Run folders: which folder a ``vlfuse fit | validate | test`` process writes into, claimed so that no
two runs share one, and the ``latest`` pointer.

Each ``vlfuse fit`` gets ``<root>/version_N/`` (``root`` is ``trainer.default_root_dir``, N one
above the highest taken, claimed with ``os.mkdir``) for its checkpoints, its model and its logs;
once it starts, ``<root>/latest`` (a relative symlink, replaced atomically) points to it. A fit
that continues a run (``--ckpt_path last``: the run ``latest`` points to; ``--ckpt_path
<root>/<run>/checkpoints/X.ckpt``: that run) writes into that run's folder, its logs into a new
``<run>/resume_K/``. ``validate`` and ``test`` log into ``<root>/validate/version_K/`` and
``<root>/test/version_K/``.

Under DDP every process must use the same folders: the process that chose them (rank 0) passes them
to the ranks Lightning starts through the environment (:func:`share_with_other_ranks`); processes
started by torchrun or srun use ``<root>/job_<id>`` (the job's id, the same in every process) or the
``--run_dir`` they are given; a job launched once per node (``NODE_RANK``, as in Lightning's on-prem
cluster guide) uses the ``--run_dir`` given to every node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

LATEST = "latest"
"""``<root>/latest``: a symlink to the folder of the latest run that ``vlfuse fit`` started or continued."""

RUN_PREFIX = "version_"
RESUME_PREFIX = "resume_"
RUN_DIR_ENV = "VLFUSE_RUN_DIR"
LOG_DIR_ENV = "VLFUSE_LOG_DIR"
"""The environment variables through which rank 0 gives the ranks Lightning starts its folders."""


@dataclass(frozen=True)
class Run:
    """Where one process of a Lightning command writes.

    Attributes:
        folder: the fit run's folder (its ``checkpoints/`` and ``model/``); for ``validate`` and ``test``,
            the run whose checkpoints ``--ckpt_path last|best`` means (``None``: there is none).
        log_dir: this process's logs and config: ``folder`` for a new run, ``folder/resume_K`` for a
            continued one, ``<root>/<subcommand>/version_K`` for an evaluation.
        leader: whether this process chose them (it prints them, moves ``latest``, and passes them to
            the other ranks).
        claimed: the folders this process created for them (:func:`release` removes them again).
    """

    folder: Path | None
    log_dir: Path
    leader: bool
    claimed: tuple[Path, ...] = ()


def claim(parent: Path, prefix: str = RUN_PREFIX, first: int = 0) -> Path:
    """Create and return ``parent/<prefix>N``, N one above the highest taken (``first`` if none is);
    ``os.mkdir`` fails for a number that another process took first, and the next one is tried."""
    parent.mkdir(parents=True, exist_ok=True)
    taken = [entry.name[len(prefix):] for entry in parent.iterdir() if entry.name.startswith(prefix)]
    number = max((int(n) + 1 for n in taken if n.isdigit()), default=first)
    while True:
        folder = parent / f"{prefix}{number}"
        try:
            os.mkdir(folder)
            return folder
        except FileExistsError:
            number += 1


def point_latest(root: Path, folder: Path) -> None:
    """Point ``<root>/latest`` at ``folder`` (relative link): a new link renamed onto the old one, so
    that a reader finds the old target or the new one."""
    root.mkdir(parents=True, exist_ok=True)
    temp = root / f".{LATEST}.tmp-{os.getpid()}"
    temp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(folder, root), temp)
    os.replace(temp, root / LATEST)


def followed(folder: Path) -> Path:
    """``folder``, or where it points if it is a symlink (``runs/x/latest`` -> ``runs/x/version_3``), so
    that a run keeps its folder when ``latest`` moves on."""
    return folder.parent / os.readlink(folder) if folder.is_symlink() else folder


def latest_run(root: Path) -> Path | None:
    """The run folder ``<root>/latest`` points to, or ``None``."""
    link = root / LATEST
    return followed(link) if link.is_symlink() and link.is_dir() else None


def has_last_checkpoint(folder: Path) -> bool:
    """Whether the run ``folder`` has a ``last*.ckpt`` (what ``--ckpt_path last`` loads)."""
    return any((folder / "checkpoints").glob("last*.ckpt"))


def run_of_checkpoint(path: Path, root: Path) -> Path | None:
    """The run folder of ``root`` that the checkpoint file ``path`` belongs to (``<root>/<run>/checkpoints/<file>``),
    or ``None``: a checkpoint from elsewhere (another root, ``<root>/checkpoints/`` of the layout before
    run folders) starts a new run."""
    if path.parent.name != "checkpoints" or not path.is_file():
        return None
    run = followed(path.parent.parent)
    return run if run.parent.resolve() == root.resolve() else None


def launched_externally() -> bool:
    """Whether the processes of a multi-process run were not all started by one Lightning process:
    torchrun (``RANK`` and ``WORLD_SIZE`` > 1), SLURM's srun (``SLURM_NTASKS`` > 1), or one launch per
    node (``NODE_RANK`` and ``WORLD_SIZE`` > 1, the environment of Lightning's on-prem multi-node jobs)."""
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    torchrun_or_per_node = several and ("RANK" in os.environ or "NODE_RANK" in os.environ)
    return torchrun_or_per_node or int(os.environ.get("SLURM_NTASKS", "1")) > 1


def launcher_rank() -> int:
    """This process's rank as the external launcher numbers it, or its node's for a per-node launch
    (0 without one): the process of rank 0 leads the run."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", os.environ.get("NODE_RANK", "0"))))


def job_folder(root: Path) -> Path:
    """``<root>/job_<id>``, the id every process of an externally launched job shares: torchrun's
    ``TORCHELASTIC_RUN_ID`` (``none`` without ``--rdzv-id`` on several nodes), else ``SLURM_JOB_ID``.

    Raises:
        ValueError: no id is known.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    job = run_id if run_id and run_id != "none" else os.environ.get("SLURM_JOB_ID")
    if not job:
        raise ValueError(
            "the processes were started by an external launcher or once per node (RANK or NODE_RANK, and WORLD_SIZE, "
            "are set) without a job id that they share: pass --run_dir DIR, the same in every process (or torchrun --rdzv-id ID)"
        )
    return root / f"job_{job}"


def continued_run(root: Path, run_dir: str | None, ckpt_path: str | None) -> Path | None:
    """The folder of the run that a fit writes into when it is not a new one: ``run_dir`` if given; for
    ``--ckpt_path last``, the latest run if it has a last checkpoint; for a checkpoint file, its run."""
    if run_dir:
        return Path(run_dir)
    if ckpt_path == "last":
        latest = latest_run(root)
        return latest if latest is not None and has_last_checkpoint(latest) else None
    return run_of_checkpoint(Path(ckpt_path), root) if ckpt_path else None


def fit_run(root: Path, run_dir: str | None, ckpt_path: str | None) -> Run:
    """The folders of a fit: a continued run's (:func:`continued_run`), else a new one (claimed, or the
    job's folder under an external launcher). The run logs into its folder while that holds nothing
    but checkpoints, else into a new ``resume_K`` in it (Lightning's CSVLogger deletes the
    ``metrics.csv`` of the folder it opens)."""
    folder = continued_run(root, run_dir, ckpt_path)
    external = launched_externally()
    if external and launcher_rank() != 0:
        folder = folder or job_folder(root)
        return Run(folder, folder, leader=False)
    if folder is None and not external:
        folder = claim(root)
        return Run(folder, folder, leader=True, claimed=(folder,))
    folder = folder or job_folder(root)
    folder.mkdir(parents=True, exist_ok=True)
    if all(entry.name == "checkpoints" for entry in folder.iterdir()):
        return Run(folder, folder, leader=True)
    log_dir = claim(folder, RESUME_PREFIX, first=1)
    return Run(folder, log_dir, leader=True, claimed=(log_dir,))


def evaluation_run(subcommand: str, root: Path, run_dir: str | None) -> Run:
    """The folders of ``validate`` or ``test``: the run named by ``run_dir`` or ``latest`` (for its
    checkpoints), and a new ``<root>/<subcommand>/version_K`` for the logs."""
    folder = Path(run_dir) if run_dir else latest_run(root)
    if launched_externally() and launcher_rank() != 0:
        return Run(folder, root / subcommand, leader=False)  # only rank 0 logs
    log_dir = claim(root / subcommand)
    return Run(folder, log_dir, leader=True, claimed=(log_dir,))


def choose(subcommand: str, root: Path, *, run_dir: str | None, ckpt_path: str | None) -> Run:
    """This process's folders: those rank 0 passed down (a rank Lightning started), else a fit's
    (:func:`fit_run`) or an evaluation's (:func:`evaluation_run`)."""
    inherited = os.environ.get(LOG_DIR_ENV)
    if inherited:
        folder = os.environ.get(RUN_DIR_ENV)
        return Run(Path(folder) if folder else None, Path(inherited), leader=False)
    if subcommand == "fit":
        return fit_run(root, run_dir, ckpt_path)
    return evaluation_run(subcommand, root, run_dir)


def release(run: Run, root: Path) -> None:
    """Remove the folders ``run`` claimed if nothing was written into them (a command that failed
    before it started), and the parents below ``root`` that this leaves empty."""
    for folder in run.claimed:
        while folder != root and root in folder.parents and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent


def share_with_other_ranks(run: Run) -> None:
    """Put ``run``'s folders in the environment, which the ranks that Lightning starts inherit."""
    os.environ[RUN_DIR_ENV] = os.path.abspath(run.folder) if run.folder else ""
    os.environ[LOG_DIR_ENV] = os.path.abspath(run.log_dir)


def forget_shared() -> None:
    """Remove what :func:`share_with_other_ranks` set, so that a later run in this process chooses anew."""
    for name in (RUN_DIR_ENV, LOG_DIR_ENV):
        os.environ.pop(name, None)
