# Sourced by scripts/demo.sh and scripts/test.sh: install torch first (so that pip never pulls a
# CUDA build of torch on a CPU machine: a torch already installed is kept), then gradcomp itself.
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q "${GRADCOMP_TORCH_SPEC:-torch==2.13.0}"
fi
python -m pip install -q -e ".[dev,data,plots]"
