# Sourced by scripts/carry_*.sh, which ready files for the GPU machine (no package index there; the device
# tool takes 64 MiB per call): what they share.

# download_cp312 DIR SPEC: SPEC's wheel for the GPU machine's Python 3.12 (x86-64 manylinux), into DIR
download_cp312() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 -d "$1" "$2"
}

# split_to_carry FILE NAME PREFIX: FILE in parts of 61000000 bytes, PREFIX0, PREFIX1, ..., one in each of
# .carry/NAME-1 .. NAME-N (the old ones removed; .carry/ kept out of git); sets CARRY_PARTS to N
split_to_carry() {
  local file=$1 name=$2 prefix=$3 tmp p
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)
  grep -qx '/.carry/' "$exclude" 2>/dev/null || echo '/.carry/' >> "$exclude"
  rm -rf ".carry/$name"-*
  tmp=$(mktemp -d)
  split -b 61000000 -d -a 1 "$file" "$tmp/$prefix"
  CARRY_PARTS=0
  for p in "$tmp/$prefix"*; do
    CARRY_PARTS=$((CARRY_PARTS + 1)); mkdir -p ".carry/$name-$CARRY_PARTS"; mv "$p" ".carry/$name-$CARRY_PARTS/"
  done
  rm -rf "$tmp"
}
