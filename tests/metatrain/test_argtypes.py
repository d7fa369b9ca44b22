"""The flags' number types: their ranges and one-line errors, and a launcher that parses them without JAX."""

import argparse
import math
import re
import subprocess
import sys

import pytest
from helpers import env

from metatrain import argtypes


@pytest.mark.parametrize("parse,text,says", [
    (argtypes.positive_int, "0", "must be >= 1, got 0"),
    (argtypes.positive_int, "1.5", "'1.5' is not a whole number"),
    (argtypes.nonnegative_int, "-1", "must be >= 0, got -1"),
    (argtypes.positive_int, "2147483648", "must be at most 2147483647 (a 32-bit integer), got 2147483648"),
    (argtypes.nonnegative_int, "99999999999999999999",
     "must be at most 2147483647 (a 32-bit integer), got 99999999999999999999"),
    (argtypes.mesh_size, "2147483648", "must be at most 2147483647 (a 32-bit integer), got 2147483648"),
    (argtypes.positive_ints, "2,2147483648",
     "must be whole numbers at most 2147483647 (a 32-bit integer), got 2,2147483648"),
    (argtypes.number(int, 0, 65535, "a TCP port"), "65536", "must be a TCP port, got 65536"),
    (argtypes.number(float, 0, math.inf, "seconds >= 0"), "nan", "must be seconds >= 0, got nan"),
    (argtypes.number(float, 0, math.inf, "seconds"), "ten", "'ten' is not a number"),
    (argtypes.positive_float, "inf", "must be a finite number > 0, got inf"),
    (argtypes.fraction("the drop"), "1", "the drop must be in (0, 1), got 1.0"),
    (argtypes.fraction("the drop", zero=True), "-0.1", "the drop must be in [0, 1), got -0.1"),
])
def test_out_of_range_says_what_the_range_is(parse, text, says):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        parse(text)
    assert str(e.value) == says


def test_values_in_range_come_back_typed():
    assert argtypes.positive_int("3") == 3 and argtypes.nonnegative_int("0") == 0
    assert argtypes.positive_int("2147483647") == argtypes.mesh_size("2147483647") == 2**31 - 1
    assert argtypes.number(float, 0, math.inf, "")("0") == 0.0 and argtypes.positive_float("1e-3") == 1e-3
    assert argtypes.fraction("x", zero=True)("0") == 0.0


def test_the_launcher_parses_its_flags_without_importing_jax():
    code = "import sys; from metatrain.launch import local; local.main(['--port', '99999', '--', 'train'])"
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, env=env(1))
    assert done.returncode == 2 and "--port: must be a TCP port" in done.stderr, done.stderr[-2000:]
    assert not re.search(r"\|\s+jax$", done.stderr, re.M), "the launcher imported jax"
