#!/usr/bin/env bash
# The device tests (tests/test_device.py) on Vulkan, over Mesa's software rasterizer lavapipe: GPU-style
# shaders running on this CPU. Builds llama-cpp-python 0.3.36 with ggml's Vulkan (+ RPC) backend in a
# venv of its own (under build/vk, or DFN_VK_WORK; ~10 minutes on 2 cores, kept for the next run),
# dflash-native against it, then runs the tests on the device "Vulkan0". .ci/run runs it.
#
#   bash bench/vulkan/lavapipe.sh [pytest args]   # from the repository root, as root (apt-get)
#
# Debian 12's libvulkan-dev (1.3.239) is too old for this ggml (ggml-vulkan.cpp needs
# vk::LayerSettingEXT): Debian 13's libvulkan-dev and spirv-headers are downloaded through a private
# apt configuration and unpacked into a prefix (nothing of the system changes); the loader stays
# Debian 12's libvulkan1.
set -euo pipefail
cd "$(dirname "$0")/../.."
work="${DFN_VK_WORK:-$PWD/build/vk}"
mkdir -p "$work"
if ! command -v glslc > /dev/null || [ ! -e /usr/share/vulkan/icd.d/lvp_icd.x86_64.json ]; then
    apt-get update -q > "$work/apt.log" && apt-get install -y -q glslc mesa-vulkan-drivers libvulkan1 >> "$work/apt.log"
fi

t="$work/trixie"
if [ ! -e "$t/prefix/usr/include/vulkan/vulkan.hpp" ]; then
    mkdir -p "$t/lists/partial" "$t/etc/sources.list.d" "$t/etc/preferences.d" "$t/debs" "$t/prefix"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
        > "$t/etc/sources.list"
    o="-o Dir::Etc::SourceList=$t/etc/sources.list -o Dir::Etc::SourceParts=$t/etc/sources.list.d
       -o Dir::State::Lists=$t/lists -o Dir::Etc::PreferencesParts=$t/etc/preferences.d"
    apt-get $o update > "$work/apt-trixie.log"
    (cd "$t/debs" && apt-get $o download libvulkan-dev spirv-headers >> "$work/apt-trixie.log" 2>&1)
    for d in "$t"/debs/*.deb; do dpkg -x "$d" "$t/prefix"; done
fi

venv="$work/venv"
if [ ! -x "$venv/bin/python" ]; then
    python -m venv --system-site-packages "$venv"
fi
if ! "$venv/bin/python" -c "import llama_cpp, pathlib, sys; p = pathlib.Path(llama_cpp.__file__).parent / 'lib'; sys.exit(0 if list(p.glob('libggml-vulkan*')) else 1)" 2>/dev/null; then
    CMAKE_ARGS="-DGGML_VULKAN=on -DGGML_RPC=on -DLLAVA_BUILD=OFF -DVulkan_INCLUDE_DIR=$t/prefix/usr/include \
-DSPIRV-Headers_DIR=$t/prefix/usr/share/cmake/SPIRV-Headers -DVulkan_LIBRARY=/usr/lib/x86_64-linux-gnu/libvulkan.so.1" \
        "$venv/bin/pip" install -q --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36
fi
SP="$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
CMAKE_ARGS="-DCMAKE_PREFIX_PATH=$SP -Dpybind11_DIR=$("$venv/bin/python" -m pybind11 --cmakedir)" \
    "$venv/bin/pip" install -q --no-build-isolation --no-deps \
    --config-settings=build-dir="$work/build" .

export GGML_VK_VISIBLE_DEVICES=0 VK_ICD_FILENAMES=/usr/share/vulkan/icd.d/lvp_icd.x86_64.json
"$venv/bin/python" -c "import dflash_native as dn; print(dn.devices())"
cd tests && DFLASH_NATIVE_TEST_DEVICE=Vulkan0 "$venv/bin/python" -m pytest -q -p no:cacheprovider test_device.py "$@"
