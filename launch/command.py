"""The metatrain command a launcher starts, checked before anything is started, created or shipped."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def check_command(command: list[str], workdir: str | None = None, include: list[str] = (),
                  devices: int | None = None) -> str | None:
    """What is wrong with the metatrain command, found before a launcher starts anything (a typo costs a second, not
    every process's start-up, or a slice's): its flags, as `metatrain` parses them (their errors exit here), and for
    `train` and `pretrain` the run config's keys, types and values (`metatrain.config.check`; the files it names are
    not looked for: on a slice they are the workers'). A `task=module:Class` is imported from the current directory
    and the `include` paths, as the processes import it.

    Args:
      command: the metatrain command line, e.g. ["train", "maml", "steps=10"].
      workdir: the work dir the launcher gives the run (`workdir=` after the command's own), if any.
      include: files and folders shipped beside the task module, whose folders the run imports from.
      devices: the devices of the whole job, where the launcher knows them: the run's mesh must split them, and its
        batch the mesh's data x fsdp devices.

    Returns:
      The config's error, or None if the command is sound.
    """
    from metatrain import cli
    from metatrain import config as config_lib
    from metatrain.cli.run import run_settings
    from metatrain.errors import ConfigError

    parser = cli.build_parser()
    parsed, unknown = parser.parse_known_args(command)
    if unknown:
        getattr(parsed, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if parsed.command not in ("train", "pretrain"):
        return None
    preset, overrides, default = run_settings(parsed)
    where = [str(Path.cwd())] + [str(Path(p).resolve().parent) for p in include]
    sys.path[:0], imported = where, set(sys.modules)
    try:
        cfg = config_lib.check(preset or default, [*overrides, *([f"workdir={workdir}"] if workdir else [])])
        if devices:
            from metatrain.sharding import check_batch, mesh_shape

            data, fsdp = mesh_shape(cfg.mesh, devices, cfg.population.size if cfg.population.axis else 0)
            check_batch(cfg.data.batch, data * fsdp)
    except ConfigError as e:
        return str(e)
    finally:
        del sys.path[:len(where)]
        for name in set(sys.modules) - imported:  # the user's modules: imported again from where the run starts
            file = getattr(sys.modules[name], "__file__", None) or ""
            if any(file.startswith(os.path.join(w, "")) for w in where):
                del sys.modules[name]
    return None
