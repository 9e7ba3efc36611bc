# Source on a GPU machine without a package index, before .ci/gpu or bench runs:
#   . bench/gpu_env.sh
# Installs carried build inputs from .fi/ (git-ignored): the nvidia-cutlass wheel (CUTLASS headers),
# FlashInfer's sources (fi_src.tar.xz, bench/pack_flashinfer_src.sh) and a prebuilt
# libjax_moe_fi.so.xz (the pack step of bench/gpu_flashinfer.sh), and exports what the source
# install needs to link against that library. JAX_MOE_FI_SCHEMES must be those it was built with.
python3 -m pip install -q --no-deps .fi/nvidia_cutlass-*.whl 2>/dev/null || echo "no .fi/nvidia_cutlass wheel"
if [ -f .fi/libjax_moe_fi.so.xz ]; then
  xz -dc .fi/libjax_moe_fi.so.xz > /tmp/libjax_moe_fi.so
  export JAX_MOE_WITH_FLASHINFER=ON JAX_MOE_FI_PREBUILT=/tmp/libjax_moe_fi.so
fi
if [ -f .fi/fi_src.tar.xz ]; then
  mkdir -p /tmp/fisrc && tar xJf .fi/fi_src.tar.xz -C /tmp/fisrc && export FLASHINFER_SRC_DIR=/tmp/fisrc/flashinfer
fi
export JAX_MOE_FI_SCHEMES="${JAX_MOE_FI_SCHEMES:-bf16;fp8;mxfp4;fp8_block}" JAX_MOE_CUDA_ARCHS="${JAX_MOE_CUDA_ARCHS:-90a}"
export CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" JAX_MOE_PIP_OFFLINE=1 PYTHONUNBUFFERED=1
