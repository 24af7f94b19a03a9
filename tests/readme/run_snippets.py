"""Runs the README's snippets exactly as printed (the C++ ones: tests/consumer_test.cmake).

    run_snippets.py sh|python SOURCE_DIR BUILD_DIR WORK_DIR

WORK_DIR becomes a stand-in for a clone after the set-up: the source tree's top-level entries as
symbolic links, `build` the build directory, and a model's config.json (the Python examples read
one). Then:
  sh      every line of every ```sh block runs in WORK_DIR with bash -e, one at a time (comments
          after `#` are the reader's); the lines in NOT_RUN are checked to be in the README and
          skipped, for the reason given there;
  python  the ```python blocks run in order as one program, with PYTHONPATH=build/python and
          the interpreter that runs this script (the set-up's environment), as the README says.

    run_snippets.py installed SOURCE_DIR PYTHON WORK_DIR

  installed  the same program with the interpreter PYTHON of an environment where posenc is
          installed, in an empty WORK_DIR (a model's config.json only) and without PYTHONPATH:
          posenc must come from that environment.
"""
import os
import re
import shutil
import subprocess
import sys
import time

# The set-up commands are the suite and the main job themselves, and the full study takes 5
# minutes (the main job runs it); every other line runs.
NOT_RUN = {
    "bash scripts/main.sh": "the main job (it runs the full study)",
    "bash scripts/test.sh": "the test suite itself",
    "build/posenc study": "the full study, 5 minutes on 2 idle Zen 5 cores: the main job",
}


def blocks(readme, language):
    return re.findall(r"^```" + language + r"\n(.*?)^```$", readme, flags=re.S | re.M)


def command_of(line):
    """The line without its trailing comment (a `#` after two spaces, outside quotes)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and line[max(0, i - 2):i] == "  ":
            return line[:i].rstrip()
    return line.rstrip()


def prepare(source, build, work):
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    for entry in os.listdir(source):
        if entry == ".git" or entry.startswith("build"):
            continue
        os.symlink(os.path.join(source, entry), os.path.join(work, entry))
    os.symlink(build, os.path.join(work, "build"))
    shutil.copy(os.path.join(source, "tests", "data", "llama-3.1-8b.json"), os.path.join(work, "config.json"))


def run_sh(readme, work):
    lines = [command_of(line) for block in blocks(readme, "sh") for line in block.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    if not lines:
        sys.exit("README.md has no ```sh line to run")
    for skipped, why in NOT_RUN.items():
        if skipped not in lines:
            sys.exit(f"NOT_RUN names `{skipped}` ({why}), which the README no longer prints")
    for line in lines:
        if line in NOT_RUN:
            print(f"-- not run: {line}  ({NOT_RUN[line]})", flush=True)
            continue
        start = time.monotonic()
        print(f"-- {line}", flush=True)
        status = subprocess.call(["bash", "-e", "-o", "pipefail", "-c", line], cwd=work)
        print(f"   ({time.monotonic() - start:.1f} s)", flush=True)
        if status != 0:
            sys.exit(f"README.md: `{line}` failed with status {status}")


def run_python(readme, work):
    code = "\n".join(blocks(readme, "python"))
    if not code:
        sys.exit("README.md has no ```python block to run")
    env = dict(os.environ, PYTHONPATH="build/python")
    status = subprocess.call([sys.executable, "-c", code], cwd=work, env=env)
    if status != 0:
        sys.exit(f"README.md's Python examples failed with status {status}")


def run_installed(readme, source, python, work):
    code = "\n".join(blocks(readme, "python"))
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    shutil.copy(os.path.join(source, "tests", "data", "llama-3.1-8b.json"), os.path.join(work, "config.json"))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    prefix = subprocess.check_output([python, "-c", "import sys; print(sys.prefix)"], env=env, text=True).strip()
    where = f"import posenc, sys; assert posenc.__file__.startswith({prefix!r}), posenc.__file__\n"
    status = subprocess.call([python, "-c", where + code], cwd=work, env=env)
    if status != 0:
        sys.exit(f"README.md's Python examples failed with status {status} in the installed package")


def main():
    kind, source, build, work = sys.argv[1:5]
    if kind == "installed":
        with open(os.path.join(source, "README.md"), encoding="utf-8") as f:
            run_installed(f.read(), source, build, work)
        print("README.md: the Python examples ran with the installed package")
        return
    with open(os.path.join(source, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    prepare(source, build, work)
    {"sh": run_sh, "python": run_python}[kind](readme, work)
    print("README.md: the " + kind + " snippets ran")


if __name__ == "__main__":
    main()
