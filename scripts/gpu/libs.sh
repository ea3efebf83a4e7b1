# Sourced by check.sh and serve_check.sh on the GPU machine. `cuda_library_path DIR` exports
# LD_LIBRARY_PATH into the calling shell (so never call it in a pipe): DIR (the packed
# libcudart) first, then PyTorch's nvidia wheels (CUDA 13 ones install into nvidia/cu13) and a
# toolkit install; it prints where each library cudarc opens by name was found.
cuda_library_path() {
    local libs="$1" sites site d lib found
    sites="$(python3 -c 'import site, sys; print(" ".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path))' 2>/dev/null || true)"
    for site in $sites; do
        for d in "$site"/nvidia/*/lib "$site"/torch/lib; do
            [ -d "$d" ] && libs="$libs:$d"
        done
    done
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        [ -d "$d" ] && libs="$libs:$d"
    done
    export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "library path: $LD_LIBRARY_PATH"
    for lib in libcuda.so.1 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13; do
        found=""
        for d in ${LD_LIBRARY_PATH//:/ } /usr/lib/x86_64-linux-gnu /usr/lib64; do
            if [ -e "$d/$lib" ]; then found="$d/$lib"; break; fi
        done
        echo "$lib: ${found:-not found in the folders above (ldconfig may still know it)}"
    done
}
