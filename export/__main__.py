def main() -> int:
    raise SystemExit("placeholder")
