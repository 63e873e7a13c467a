# Sourced by the study scripts: `study_folder NAME` prints results/study/NAME-<profile>, the folder a study's cells
# land in on this machine. The suffix is the CPU profile that fixes the cells' trainer (docs/cpu.md): avx512 where bf16
# is native (the name the bf16 studies always had), fp32 where it is emulated; a study folder never mixes the two
# (the studies refuse a sitting of the other profile), so each machine kind resumes its own. Needs $ROOT and the venv.
study_folder() {
    local profile
    profile=$("$ROOT/.venv/bin/python" -c \
        "from openrlhf_tis.cpu_features import native_bf16; print('avx512' if native_bf16() else 'fp32')")
    echo "$ROOT/results/study/$1-$profile"
}
