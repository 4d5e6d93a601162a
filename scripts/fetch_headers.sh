#!/usr/bin/env bash
# Fetches the third-party headers the native build needs, into third_party/ (git-ignored):
#   third_party/onnxruntime/include  from Debian trixie's libonnxruntime-dev .deb (ORT's pip
#                                    wheels ship no headers); the .deb is extracted, never installed
#   third_party/tensorrt/include     from the kernel-lens wheel on PyPI (public TensorRT 10.14 headers)
# Already-present folders are kept. ORT_INCLUDE_DIR / TENSORRT_INCLUDE_DIR, when set, win in CMake
# and make this script unnecessary.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/third_party"
mkdir -p "$dest"

fetch_ort() {
  local out="$dest/onnxruntime/include"
  if [ -f "$out/onnxruntime_cxx_api.h" ]; then echo "fetch_headers: ONNX Runtime headers present in $out"; return; fi
  local work; work="$(mktemp -d)"
  mkdir -p "$work/lists/partial" "$work/archives/partial"
  echo "deb http://deb.debian.org/debian trixie main" > "$work/sources.list"
  local apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
                  -o "Dir::State::Lists=$work/lists" -o "Dir::Cache::Archives=$work/archives"
                  -o "Debug::NoLocking=1")
  echo "fetch_headers: fetching libonnxruntime-dev from Debian trixie"
  apt-get "${apt_opts[@]}" update -qq
  (cd "$work" && apt-get "${apt_opts[@]}" download libonnxruntime-dev >/dev/null)
  dpkg -x "$work"/libonnxruntime-dev_*.deb "$work/x"
  local hdr; hdr="$(dirname "$(find "$work/x" -name onnxruntime_cxx_api.h | head -n1)")"
  [ -f "$hdr/onnxruntime_cxx_api.h" ] || { echo "fetch_headers: no onnxruntime_cxx_api.h in the .deb" >&2; exit 1; }
  mkdir -p "$out" && cp -r "$hdr"/. "$out"/
  rm -rf "$work"
  echo "fetch_headers: ONNX Runtime headers in $out"
}

fetch_trt() {
  local out="$dest/tensorrt/include"
  if [ -f "$out/NvInfer.h" ]; then echo "fetch_headers: TensorRT headers present in $out"; return; fi
  local work; work="$(mktemp -d)"
  echo "fetch_headers: fetching the kernel-lens wheel (TensorRT headers)"
  python3 -m pip download -q --no-deps -d "$work" kernel-lens
  python3 - "$work" "$out" <<'PY'
import pathlib, sys, zipfile
work, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = next(work.glob("kernel_lens-*.whl"))
prefix = "kernel_lens/include/tensorrt/"
with zipfile.ZipFile(wheel) as zf:
    names = [n for n in zf.namelist() if n.startswith(prefix) and not n.endswith("/")]
    if not names:
        sys.exit(f"fetch_headers: {wheel.name} holds no {prefix}")
    for n in names:
        target = out / n[len(prefix):]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(zf.read(n))
PY
  rm -rf "$work"
  echo "fetch_headers: TensorRT headers in $out"
}

fetch_ort
fetch_trt
