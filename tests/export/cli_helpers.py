"""Running the export CLI in this process, and what its refusals must look like."""


def run_main(capsys, *args):
    """(exit status, stderr) of the CLI's main() in this process (argparse's errors exit)."""
    from turboquant.export.__main__ import main

    capsys.readouterr()  # what came before (a fixture building its model) is not the CLI's
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def assert_refused(rc, err, message):
    lines = err.strip().splitlines()
    assert rc == 2 and message in lines[-1] and "Traceback" not in err, err
    assert len(lines) == 1 or lines[0].startswith("usage:"), err


def tree(folder):
    """Every path under folder with its bytes (None for a folder)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}
