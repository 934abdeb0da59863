#!/usr/bin/env bash
# Photos on a GPU worker, in one 10-minute call on the GPU machine: tests/gpu/test_device_photos.py (a broker
# and GPU worker decoding with nvJPEG and preprocessing on the device; scores of real photographs against the
# CPU reference recipe; corrupt, truncated, non-image, oversized and bomb rows; the decoder named; the stage's
# rows against the CPU preset's and its in-process images/s; with tests/gpu/test_finishgraphs.py), then each
# test's figures, then the photo bench's (a), (b) and (c) on bench/gpu_photos.toml (`shmbroker bench --photos
# --quick`). The bench's report and JSON go to $OUT (default /tmp/gpu-photos), the logs, the tests' figures and
# the profiles into $OUT/more.tgz. The machine's image lacks some of shmbroker's dependencies: fetch them here
# with
#   ../shared/device/prepare-wheels.sh msgspec==0.23.0 prometheus-client==0.26.0 rich==15.0.0 \
#     markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 onnxconverter-common==1.16.0
# (add nvidia-nvjpeg==13.2.3.58 if the preflight below says torchvision finds no libnvjpeg, py-spy==0.4.1 for
# PROFILE=1 below) and carry .whl:
# this script installs them with that script's install line. The image lacks the packages that ship the test
# photographs (scikit-image, scikit-learn, matplotlib, mate-backgrounds): write them here with
#   python -m shmbroker.bench.photoset --export .gpu/photos        (about 15 MB)
# and carry .gpu/photos too; this script points SHMBROKER_PHOTO_DIR at them. nvImageCodec's wheel (27 MB) with
# nvJPEG's does not fit beside those: carry .gpu/nvimgcodec.tgz, the parts of them a cp312 worker loads, made with
#   pip download --no-deps --only-binary :all: --python-version 3.12 --platform manylinux2014_x86_64 -d W \
#     nvidia-nvimgcodec-cu13==0.6.1.37 nvidia-nvjpeg==13.3.2.43
#   mkdir P && cd P && for w in ../W/*.whl; do unzip -q "$w" 'nvidia/*'; done && rm nvidia/__init__.py \
#     nvidia/nvimgcodec/nvimgcodec_impl.cpython-3{8,9,10,11,13,13t}-* \
#     nvidia/nvimgcodec/extensions/lib{nvjpeg2k,nvtiff,opencv,tiff}_ext* && tar czf ../.gpu/nvimgcodec.tgz nvidia
# (10.5 MB); without it the stage decodes with torchvision (gpu_worker/devicedecoders.py).
#   bash bench/gpu_photos.sh
set -uo pipefail
out=${OUT:-/tmp/gpu-photos}
mkdir -p "$out"
# nvImageCodec's warnings (a row it could not decode, and why) and a crash's Python stack into the logs
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHONPATH=$PWD PYNVIMGCODEC_VERBOSITY=${PYNVIMGCODEC_VERBOSITY:-2}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit
  export PYTHONPATH=/tmp/site:$PWD
fi
if [ -f .gpu/nvimgcodec.tgz ]; then
  mkdir -p /tmp/site && tar xzf .gpu/nvimgcodec.tgz -C /tmp/site
  # where the image's `nvidia` is a regular package, it hides the namespace portion in /tmp/site: add the
  # module to that package instead (this machine is thrown away after the session)
  if ! python3 -c 'from nvidia import nvimgcodec' 2>/dev/null; then
    pkg=$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__file__ or ""))' 2>/dev/null)
    if [ -n "$pkg" ] && [ -d "$pkg" ]; then cp -r /tmp/site/nvidia/nvimgcodec "$pkg/"; fi
  fi
fi
if [ -d .gpu/photos ]; then export SHMBROKER_PHOTO_DIR=$PWD/.gpu/photos; fi
for lib in /tmp/site/nvidia/*/lib; do  # a carried nvidia-nvjpeg: torch preloads only its own CUDA libraries
  if [ -d "$lib" ]; then export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 - <<'PY' 2>&1 | tee "$out/preflight.txt"
import io
import torch, torchvision
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg
buf = io.BytesIO()
Image.new("RGB", (64, 48), (1, 2, 3)).save(buf, "JPEG")
print("torch", torch.__version__, "torchvision", torchvision.__version__, "CUDA", torch.version.cuda)
t = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
print("decode_jpeg on cuda:", tuple(decode_jpeg([t], mode=ImageReadMode.RGB, device="cuda")[0].shape))
from shmbroker.gpu_worker.devicedecoders import NoDecoder, open_decoder
try:
    print("the stage's decoder:", open_decoder(torch, 0).backend)
except NoDecoder as exc:
    print("no decoder:", exc.reasons)
PY
SHMBROKER_GPU_PHOTOS_OUT="$out/figures" timeout "${TESTS_S:-520}" python3 -m pytest -q -p no:cacheprovider -rs \
  tests/gpu/test_device_photos.py tests/gpu/test_finishgraphs.py > "$out/tests.log" 2>&1
echo "pytest exit $?"
tail -n 40 "$out/tests.log"
python3 - "$out/figures" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    print(f"{f.stem}: {json.dumps(json.loads(f.read_text()))}")
PY
# examples/c's client for (b'), built against the libzmq of pyzmq's wheel; where the machine has no zmq.h,
# carry libzmq3-dev's as .gpu/zmq.h (cp /usr/include/zmq.h .gpu/)
cclient=()
zlib=$(compgen -G "/tmp/site/pyzmq.libs/libzmq-*.so*" | head -n 1)
zinc=/usr/include; [ -f $zinc/zmq.h ] || zinc=.gpu
if [ -n "$zlib" ] && [ -f $zinc/zmq.h ] && command -v cc > /dev/null; then
  if cc -O2 -std=c11 -I"$zinc" -o /tmp/shmb_client examples/c/shmb_client.c "$zlib" \
      -Wl,-rpath,"$(dirname "$zlib")"; then cclient=(--c-client /tmp/shmb_client); fi
fi
echo "C client for (b'): ${cclient[*]:-none}"
# the acceptance benches (a), (b), (c) on the GPU worker, while time is left (BENCH_S, default 300 s); more
# options in PHOTOS_ARGS (the tests' limit is TESTS_S, default 520 s), e.g. "--sizes 640x480 --client-spin-us 0"
timeout "${BENCH_S:-300}" python3 -m shmbroker.bench.photos --config bench/gpu_photos.toml --quick \
  --out "$out/photos.json" ${cclient[@]+"${cclient[@]}"} ${PHOTOS_ARGS:-} > "$out/photos.md" 2> "$out/photos.log"
echo "bench.photos exit $?"
cat "$out/photos.md"; tail -n 5 "$out/photos.log"
# PROFILE=1 (a py-spy wheel in .whl): then one more run at 640x480 with 6 s windows, py-spy attached for a few
# seconds, native frames and waiting threads included, to the bench process in (a)'s first window
# ($out/profile_a.txt) and to the worker in (b)'s ($out/profile_b.txt), and at the same time to (b)'s first client
# process ($out/profile_client.txt); py-spy's raw format, one stack a line
if [ -n "${PROFILE:-}" ] && [ -x /tmp/site/bin/py-spy ]; then
  log=$out/profiled.log
  python3 -m shmbroker.bench.photos --config bench/gpu_photos.toml --quick --duration 6 --sizes 640x480 \
    --out "$out/profiled.json" ${PHOTOS_ARGS:-} > "$out/profiled.md" 2> "$log" &
  bench=$!  # py-spy needs the bench's own pid, so no `timeout` in front: PROFILE_S (default 150 s) ends it
  (sleep "${PROFILE_S:-150}"; kill "$bench" 2>/dev/null) &
  upto() { until grep -qF "$1" "$log" || ! kill -0 "$bench" 2>/dev/null; do sleep 0.2; done; }
  spy() { /tmp/site/bin/py-spy record -p "$1" -d "$2" -r 100 --native --idle --threads --format raw -o "$3" \
    > "$3.log" 2>&1; echo "py-spy on $1: exit $? ($(wc -l < "$3") stacks)"; }
  upto "(a) in-process limit, 6 s (window 1"
  spy "$bench" 4 "$out/profile_a.txt"
  upto "(b) broker"
  sleep 2  # the clients' warm-up
  spy "$(pgrep -x shmb-bench-0 | head -n 1)" 4 "$out/profile_client.txt" & client=$!
  spy "$(pgrep -x shmb-worker-0 | head -n 1)" 4 "$out/profile_b.txt"
  wait "$client"
  wait "$bench"; echo "profiled bench exit $?"; grep -F "(b) window" "$log"
fi
# the device machine sends back only a few files: all but the bench's report and JSON go in one archive
(cd "$out" && find . -type f ! -name photos.md ! -name photos.json ! -name more.tgz -print0 \
  | tar czf more.tgz --null -T - --remove-files)
