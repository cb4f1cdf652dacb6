# Sourced by the benchmarks/gpu_session*.sh device scripts: the repository root as the working directory, the
# environment every step runs in, and `step NAME TIMEOUT CMD...`, which runs CMD under the timeout with its output
# in $R/NAME.log and its exit status appended to $R/rc.txt (a failed step does not stop the script), and
# `install_wheels`, which installs the carried wheels (.whl) into /tmp/site and puts it on PYTHONPATH.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT/r"; R="$OUT/r"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
step() { local name=$1 t=$2; shift 2
  timeout "$t" "$@" > "$R/$name.log" 2>&1; echo "$name rc=$?" | tee -a "$R/rc.txt"; }
install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$R/wheels.log" 2>&1; echo "wheels rc=$?" | tee -a "$R/rc.txt"
  export PYTHONPATH=.:/tmp/site
  python3 -c "import tokamax, qwix; print('tokamax', tokamax.__version__)" 2>&1 | tail -2 | tee -a "$R/wheels.log"; }
