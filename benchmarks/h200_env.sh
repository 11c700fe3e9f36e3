# Sourced by the h200_*.sh scripts: the carried wheels (.whl) and flashinfer's modules (.fi,
# python benchmarks/h200_carry.py) on the lent H200's python3, and where logs go ($OUT).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.fi:$PWD PYTHONUNBUFFERED=1 FP4SELECT_CACHE_DIR=/tmp/fp4select-cache
OUT=${OUT:-benchmarks/results}
