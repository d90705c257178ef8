"""How the sweeps' tables and estimates name things: a config file, a wall time."""

import math
import os


def config_label(config_file: str) -> str:
    """How the table names ``config_file``: one of sn_detection's configs as ``configs/NAME``, its path in a
    checkout, however it was reached and whichever copy it is: a checkout's ``configs/`` (the folder beside
    ``sn_detection/``; any checkout, such as a worktree at the commit a sweep runs) or an installed
    package's ``sn_detection/configs``; any other as given."""
    folder, parts = os.path.realpath(config_file), []
    while os.path.dirname(folder) != folder:
        folder, part = os.path.split(folder)
        parts.insert(0, part)
        installed = os.path.basename(folder) == "sn_detection"
        if part == "configs" and (installed or os.path.isdir(os.path.join(folder, "sn_detection"))):
            return "/".join(parts)
    return config_file


def format_duration(seconds: float) -> str:
    """A wall time as a person reads it: seconds, minutes, or hours from 1.5 h on; NaN is "unknown"."""
    if math.isnan(seconds):
        return "unknown"
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min"
