#!/usr/bin/env bash
# The GPU evidence, in stages, on the GPU machine (each stage fits one 10-minute call):
#   device run, carry [".whl"]:  bash benchmarks/gpu_run.sh tests profiles kernels lora adamw norms attention throughput
#   tests       the GPU tests: test_gpu.py and the kernels' (GPU_TESTS below) -> gpu-tests.log
#               (TESTS="pytest arguments" narrows it; quotes inside it are honoured:
#               TESTS="tests/test_kernels.py -k 'fast or exact'"; SHARDS=n: n processes, process g on
#               GPU g % (the GPUs), test i of the collection in process i % n -> gpu-tests-<i>.log),
#               then benchmarks/wait_first.py over every kernel they compiled: each waits for the
#               kernel before it before it touches memory             -> wait-first.json
#   profiles    benchmarks/gpu_profiles.py (the profile matrix)      -> <date>-h200-profiles.json
#   kernels     benchmarks/nf4_kernels.py (fused NF4 against dense)  -> <date>-h200-nf4-kernels.json
#               (KERNELS=--quick: the 4096 x 4096 points only; "--defaults --problems N,K,M ...": the default rows there)
#   ws          benchmarks/nf4_ws.py (a warp-specialized NF4 product) -> <date>-h200-nf4-ws.json
#   rs          benchmarks/nf4_rs.py (the NF4 products with the weight as the MMA's register operand; RS="0 5": its
#               variants 0 and 5, in that order)
#                                                                     -> <date>-h200-nf4-rs.json
#   barriers    benchmarks/nf4_rs_barriers.py (nf4_rs as compiled against its PTX without the MMA partitions'
#               warpgroup barriers at each ring slot; alternated processes)   -> <date>-h200-nf4-rs-barriers.json
#   partial     benchmarks/nf4_rs_partial.py (nf4_rs timed with 4, 3, 2 and 0 of each lookup's four code words
#               decoded, the rest handed to the MMA undecoded, and with the second warpgroup's decode left
#               out; timing only: whether a warp's latency or the shuffles' throughput sets the pace;
#               PARTIAL="4 shared1 shared2 shared4 3" picks the runs, shared-n reading n words from shared memory;
#               "amconst", "amone", "amhalf": the input gradient's absmax never read, or 1 or 4 of 8 used a lookup)
#                                                                     -> <date>-h200-nf4-rs-partial.json
#   check       benchmarks/nf4_rs_check.py (nf4_rs against nf4_ws, bit for bit, at the shapes training calls
#               it with: Llama-3.2-1B's and SmolLM2-135M's projections and heads) -> <date>-h200-nf4-rs-check.json
#   ncu         benchmarks/nf4_profile.py under Nsight Compute (--set full): dense, nf4_rs (and its steps one at a
#               time, each also without the decode), nf4_ws at 4096 x 4096 x 2048 (NCU="N K M" another shape);
#               the input gradient: dense, nf4_rs through the transposed copy, and it without the decode
#               (NF4_PROFILE=absmax: the input gradient's dense, nf4_rs, and it with 8 or 2 of a step's 16 absmax)
#               -> nf4-profile.ncu-rep, -details.txt, -raw.csv, -sass.csv (the sampled stalls of each SASS line)
#               and <date>-h200-nf4-profile.json (each launch's time, tensor pipe share, and by opcode its
#               shared-memory wavefronts and sampled stalls; its most sampled SASS lines)
#   lora        benchmarks/lora_kernels.py (fused adapter kernels)   -> <date>-h200-lora-kernels.json
#               (LORA=--sweep: the tile grid at every shape of a Llama-3.2-1B and Llama-3.1-8B update)
#   adamw       benchmarks/adamw.py (ours against torch.optim.AdamW) -> <date>-h200-adamw.json
#   norms       benchmarks/norm_kernels.py (RMSNorm backward, sum_splits) -> <date>-h200-norm-kernels.json
#   attention   benchmarks/attention.py (fused causal attention against PyTorch's) -> <date>-h200-attention.json
#   cudnn       benchmarks/attention_cudnn.py (cuDNN's deterministic attention against ours) -> <date>-h200-attention-cudnn.json
#   ce          benchmarks/cross_entropy.py (the fused cross-entropy's variants; OLD: an earlier tree's too)
#                                                                     -> <date>-h200-cross-entropy.json
#   joined      benchmarks/joined_delta.py (an adapter's delta joined to its base's GEMM along K against
#               expand's delta added by the GEMM; then du @ A joined to a base's input gradient, o and down)
#                                                                     -> <date>-h200-joined-delta.json
#   bandwidth   benchmarks/adapter_bandwidth.py (project and reduce_tokens against cuBLAS on the same BF16
#               parts and a plain read)                               -> <date>-h200-adapter-bandwidth.json
#   head        benchmarks/head_chunks.py (the head's products over 8 x 1024 positions, a chunk at a time,
#               at several chunk sizes)                               -> <date>-h200-head-chunks.json
#   epilogue    benchmarks/mlp_epilogue.py (the SwiGLU inside the MLP's GEMMs against cuBLAS's GEMMs and the SwiGLU
#               kernel apart, forward and backward, at QLoRA's MLP of each of MODELS, default llama-3.2-1b, also
#               llama-3.1-8b)                                         -> <date>-h200-mlp-epilogue-<model>.json
#   mlpprobe    benchmarks/mlp_probe.py (the SwiGLU inside the MLP's GEMMs against the GEMMs alone, forward and
#               backward: the kernels, an earlier tree's (OLD), the backward with its gate/up copies or stores left out)
#                                                                     -> <date>-h200-mlp-probe.json
#   rounding    benchmarks/delta_rounding.py (how much of a small adapter delta reaches a BF16 output: cuBLAS's GEMM
#               onto a BF16 C, the fused path's expand and GEMM, the delta joined along K)
#                                                                     -> <date>-h200-delta-rounding.json
#   blas        benchmarks/blas_library.py (cuBLAS against cuBLASLt at Llama-3.2-1B QLoRA's GEMMs; TRAIN=combo: then
#               throughput.py's own side a process a library, alternated) -> <date>-h200-blas-library.json
#   decodes     benchmarks/decode_tiles.py (the whole-weight NF4 decode at several program tiles, at every shape a
#               QLoRA update of Llama-3.2-1B and Llama-3.1-8B decodes; the same bits as the default's) -> <date>-h200-decode-tiles.json
#   ropetiles   benchmarks/rope_tiles.py (the RoPE kernel at several program tiles, forward and backward at
#               Llama-3.2-1B's and Llama-3.1-8B's attention; the same bits as the default's) -> <date>-h200-rope-tiles.json
#   joint       benchmarks/joint_gemms.py (a group's projections as one GEMM against one a weight) -> <date>-h200-joint-gemms.json
#   overlap     benchmarks/overlap.py (AdamW and the clipping norm's squares on a second stream beside
#               the GEMMs: whether they hide)                         -> <date>-h200-overlap.json
#   energy      benchmarks/energy.py (joules an update, mean power and SM clock, ours against the peer;
#               COMBOS, default llama-3.2-1b:full:cudnn)              -> <date>-h200-energy.json
#   clocks      benchmarks/update_clocks.py (each update beside the SM clock, power, throttle reasons;
#               COMBO, default llama-3.2-1b:full:cudnn)                -> update-clocks.log
#   throughput  benchmarks/throughput.py (ours against the peer)     -> <date>-h200.json, its rows as the
#               README's table at the end of throughput.log
#               (COMBOS="model:method ... [--rounds R]" narrows it; R rounds alternate the two sides)
#   rsab        nf4_rs's forward and input gradient timed and checked as `partial`'s run 4 does, an earlier tree
#               (OLD, as for ab) against this one, alternated ROUNDS times (default 2), one process each
#               (TREES="a b ...": those folders' trees in turn, the one named by $PWD "new", the others
#               by folder name; a process stopped after 300 s)        -> rsab.log, rsab-{old|folder,new}-N.json
#   ab          ours only, an earlier tree against this one, alternated ROUNDS times (default 2), one
#               process each: OLD=a folder holding that tree's src/ and benchmarks/throughput.py
#               (`bash benchmarks/carry.sh COMMIT` puts a commit's there: OLD=.whl/COMMIT) -> ab.log, ab-{old,new}-N.json
#   same        ours only, ROUNDS (default 3) separate processes of this tree, then benchmarks/same_bits.py:
#               every combination's losses equal to the last bit (COMBOS, default llama-3.2-1b:qlora
#               --steps 20) -> same.log, same-N.json
#   first       benchmarks/first_update_bits.py: PROCESSES (default 8) processes of COMBO (default
#               llama-3.2-1b:qlora:cudnn:fused), each a digest of every tensor its first update reads, that
#               update's graph replayed twice and its loss, and which differ from the first process's
#               (UPDATES, default 1; FILLS, default none, cycled over the processes: what a
#               process's new tensors hold: none, or PyTorch's NaN fill, e.g. FILLS="none nan"; NAMES, default 1:
#               the names of the kernels each process's eager pass runs, cuBLAS's and cuDNN's choices among
#               them, NAMES=0 none; LAYERS, default all: the model's first LAYERS layers only; PARALLEL,
#               default 1: processes at once, each with cores / PARALLEL host threads)
#                                                                     -> <date>-h200-first-update-bits.json
#   rope        benchmarks/rope_bits.py: PROCESSES (default 200) fresh processes, PARALLEL (default 2) at once,
#               each taking RoPE's cos and sin with PyTorch's CPU kernels twice: the values unequal to
#               the C library's in each call                          -> <date>-h200-rope-bits.json
#   plans       benchmarks/cudnn_plans.py: PROCESSES (default 96) light processes, PARALLEL (default 8) at once, each
#               building cuDNN's attention at Llama-3.2-1B's heads: its plans, the frontend's log of its choice
#               and the bits of its outputs, which differ from the first process's  -> <date>-h200-cudnn-plans.json
#   replay      ours only, every update's recorded graph replayed REPLAYS (default 50) more times over
#               the same inputs, each compared with the first to the last bit (benchmarks/replay_bits.py;
#               COMBOS, default llama-3.2-1b:qlora) -> <date>-h200-replay-bits.json
#   profile     where one update's GPU time goes (SmolLM2 and Llama-3.2-1B LoRA, eager loop:
#               the kernels a recorded graph replays; PROFILES="model:method:eager ..." chooses)
# Results land in $OUT. Prepare .whl (an ignored folder) here first: bash benchmarks/carry.sh [COMMIT ...]
set -uo pipefail
GPU_TESTS="tests/test_gpu.py tests/test_kernels.py tests/test_lora_kernels.py tests/test_adamw_kernel.py tests/test_attention.py
           tests/test_layer_kernels.py tests/test_cross_entropy_kernel.py tests/test_launch.py"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
export ANER_TOKENIZER_GGUF=$PWD/.whl/smollm2-tokenizer.gguf
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}   # fresh on a fresh machine; read by wait_first.py
day=$(date +%Y-%m-%d)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for stage in "$@"; do
  echo "== $stage $(date +%T)"
  case $stage in
    tests) eval "tests=(${TESTS:-$GPU_TESTS})"
           if [ "${SHARDS:-1}" = 1 ]; then
             python3 -m pytest -q -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 30
           else      # test i of the collection in process i % SHARDS, process g on GPU g % (the GPUs)
             python3 -m pytest -q -p no:cacheprovider --collect-only "${tests[@]}" | grep '::' > /tmp/ids
             gpus=$(nvidia-smi -L 2>/dev/null | grep -c GPU); gpus=$((gpus > 0 ? gpus : 1))
             threads=$(($(nproc) / SHARDS)); threads=$((threads > 0 ? threads : 1))
             for g in $(seq 0 $((SHARDS - 1))); do
               mapfile -t ids < <(awk -v g=$g -v n=$SHARDS 'NR % n == g' /tmp/ids)
               CUDA_VISIBLE_DEVICES=$((g % gpus)) OMP_NUM_THREADS=$threads \
                 python3 -m pytest -q -p no:cacheprovider "${ids[@]}" > "$OUT/gpu-tests-$g.log" 2>&1 &
             done
             wait; tail -n 3 "$OUT"/gpu-tests-*.log
           fi
           python3 benchmarks/wait_first.py "$TRITON_CACHE_DIR" "$OUT/wait-first.json" ;;
    profiles) python3 benchmarks/gpu_profiles.py "$OUT/$day-h200-profiles.json" 2>&1 | tee "$OUT/gpu-profiles.log" ;;
    ws) python3 benchmarks/nf4_ws.py "$OUT/$day-h200-nf4-ws.json" 2>&1 | tee "$OUT/nf4-ws.log" | tail -n 40 ;;
    rs) python3 benchmarks/nf4_rs.py "$OUT/$day-h200-nf4-rs.json" ${RS:-} 2>&1 | tee "$OUT/nf4-rs.log" | tail -n 40 ;;
    barriers) python3 benchmarks/nf4_rs_barriers.py "$OUT/$day-h200-nf4-rs-barriers.json" 2>&1 | tee "$OUT/nf4-rs-barriers.log" | tail -n 40 ;;
    partial) python3 benchmarks/nf4_rs_partial.py "$OUT/$day-h200-nf4-rs-partial.json" ${PARTIAL:-} 2>&1 | tee "$OUT/nf4-rs-partial.log" | tail -n 40 ;;
    check) PYTHONPATH=$PYTHONPATH:$PWD/benchmarks python3 benchmarks/nf4_rs_check.py "$OUT/$day-h200-nf4-rs-check.json" 2>&1 \
             | tee "$OUT/nf4-rs-check.log" | tail -n 20 ;;
    ncu) PYTHONPATH=$PYTHONPATH:$PWD/benchmarks ncu --clock-control none --profile-from-start off --set full \
           --import-source no -f -o "$OUT/nf4-profile" python3 benchmarks/nf4_profile.py ${NCU:-} 2>&1 | tail -n 5
         ncu -i "$OUT/nf4-profile.ncu-rep" --page details --print-details all > "$OUT/nf4-profile-details.txt"
         ncu -i "$OUT/nf4-profile.ncu-rep" --page raw --csv > "$OUT/nf4-profile-raw.csv"
         ncu -i "$OUT/nf4-profile.ncu-rep" --page source --csv --print-source sass > "$OUT/nf4-profile-sass.csv" 2>&1
         python3 benchmarks/nf4_profile.py --summary "$OUT/nf4-profile-raw.csv" "$OUT/nf4-profile-sass.csv" \
           "$OUT/$day-h200-nf4-profile.json"
         grep -E "^  [a-z_]|Duration|Throughput|Busy|Issue Slots|Warp Cycles|L2 Hit|Eligible" "$OUT/nf4-profile-details.txt" | head -n 120 ;;
    kernels) python3 benchmarks/nf4_kernels.py "$OUT/$day-h200-nf4-kernels.json" ${KERNELS:-} 2>&1 | tee "$OUT/nf4-kernels.log" | tail -n 40 ;;
    adamw) python3 benchmarks/adamw.py "$OUT/$day-h200-adamw.json" --device cuda:0 --models smollm2-135m llama-3.2-1b 2>&1 \
             | tee "$OUT/adamw.log" ;;
    norms) python3 benchmarks/norm_kernels.py "$OUT/$day-h200-norm-kernels.json" 2>&1 | tee "$OUT/norm-kernels.log" ;;
    attention) python3 benchmarks/attention.py "$OUT/$day-h200-attention.json" 2>&1 | tee "$OUT/attention.log" ;;
    cudnn) PYTHONPATH=$PYTHONPATH:$PWD/benchmarks python3 benchmarks/attention_cudnn.py "$OUT/$day-h200-attention-cudnn.json" 2>&1 \
             | tee "$OUT/attention-cudnn.log" ;;
    ce) python3 benchmarks/cross_entropy.py "$OUT/$day-h200-cross-entropy.json" ${OLD:+--old "$OLD"} 2>&1 \
          | tee "$OUT/cross-entropy.log" ;;
    bandwidth) PYTHONPATH=$PYTHONPATH:$PWD/benchmarks python3 benchmarks/adapter_bandwidth.py \
                 "$OUT/$day-h200-adapter-bandwidth.json" 2>&1 | tee "$OUT/adapter-bandwidth.log" ;;
    joined) PYTHONPATH=$PYTHONPATH:$PWD/benchmarks python3 benchmarks/joined_delta.py "$OUT/$day-h200-joined-delta.json" 2>&1 \
              | tee "$OUT/joined-delta.log" ;;
    head) python3 benchmarks/head_chunks.py "$OUT/$day-h200-head-chunks.json" 2>&1 | tee "$OUT/head-chunks.log" ;;
    epilogue) export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks    # small shapes first, under a limit: a kernel that hangs stops there
              timeout 120 python3 benchmarks/mlp_epilogue.py /tmp/smoke.json smoke 2>&1 | tee "$OUT/mlp-epilogue-smoke.log" &&
                for model in ${MODELS:-llama-3.2-1b}; do
                  python3 benchmarks/mlp_epilogue.py "$OUT/$day-h200-mlp-epilogue-$model.json" $model 2>&1 \
                    | tee "$OUT/mlp-epilogue-$model.log"
                done ;;
    mlpprobe) PYTHONPATH=$PYTHONPATH:$PWD/benchmarks timeout 300 python3 benchmarks/mlp_probe.py "$OUT/$day-h200-mlp-probe.json" ${OLD:-} 2>&1 \
                | tee "$OUT/mlp-probe.log" ;;
    rounding) python3 benchmarks/delta_rounding.py "$OUT/$day-h200-delta-rounding.json" 2>&1 | tee "$OUT/delta-rounding.log" ;;
    blas) python3 benchmarks/blas_library.py "$OUT/$day-h200-blas-library.json" ${TRAIN:+--train "$TRAIN"} 2>&1 \
            | tee "$OUT/blas-library.log" ;;
    decodes) PYTHONPATH=$PYTHONPATH:$PWD/benchmarks python3 benchmarks/decode_tiles.py "$OUT/$day-h200-decode-tiles.json" 2>&1 \
               | tee "$OUT/decode-tiles.log" ;;
    ropetiles) PYTHONPATH=$PYTHONPATH:$PWD/benchmarks python3 benchmarks/rope_tiles.py "$OUT/$day-h200-rope-tiles.json" 2>&1 \
                 | tee "$OUT/rope-tiles.log" ;;
    joint) python3 benchmarks/joint_gemms.py "$OUT/$day-h200-joint-gemms.json" 2>&1 | tee "$OUT/joint-gemms.log" ;;
    lora) python3 benchmarks/lora_kernels.py "$OUT/$day-h200-lora-kernels.json" ${LORA:-} 2>&1 | tee "$OUT/lora-kernels.log" | tail -n 60 ;;
    overlap) python3 benchmarks/overlap.py "$OUT/$day-h200-overlap.json" 2>&1 \
               | tee "$OUT/overlap.log" ;;
    energy) python3 benchmarks/energy.py "$OUT/$day-h200-energy.json" ${COMBOS:-} 2>&1 \
              | tee "$OUT/energy.log" | grep -v "^ *$" ;;
    clocks) python3 benchmarks/update_clocks.py ${COMBO:-} 2>&1 | tee "$OUT/update-clocks.log" | grep -v "^   " ;;
    throughput) python3 benchmarks/throughput.py "$OUT/$day-h200.json" ${COMBOS:-} 2>&1 | tee "$OUT/throughput.log"
                python3 benchmarks/throughput.py --table "$OUT/$day-h200.json" | tee -a "$OUT/throughput.log" ;;
    rsab) for round in $(seq "${ROUNDS:-2}"); do for tree in ${TREES:-$OLD $PWD}; do
            name=$(if [ "$tree" = "$PWD" ]; then echo new; elif [ -z "${TREES:-}" ]; then echo old; else basename "$tree"; fi)
            PYTHONPATH=/tmp/site:$tree/src:$PWD/benchmarks timeout 300 python3 benchmarks/nf4_rs_partial.py --run 4 \
              2>&1 > "$OUT/rsab-$name-$round.json" | sed "s/^/$name /"
          done; done | tee "$OUT/rsab.log" ;;
    ab) for round in $(seq "${ROUNDS:-2}"); do for tree in "$OLD" "$PWD"; do
          name=$([ "$tree" = "$PWD" ] && echo new || echo old)
          python3 "$tree/benchmarks/throughput.py" "$OUT/ab-$name-$round.json" --no-peer ${COMBOS:-} 2>&1 | sed "s/^/$name /"
        done; done | tee "$OUT/ab.log" ;;
    first) python3 benchmarks/first_update_bits.py "$OUT/$day-h200-first-update-bits.json" \
             --combo "${COMBO:-llama-3.2-1b:qlora:cudnn:fused}" --processes "${PROCESSES:-8}" \
             --layers "${LAYERS:-0}" --parallel "${PARALLEL:-1}" \
             --updates "${UPDATES:-1}" --fills ${FILLS:-none} $([ "${NAMES:-1}" = 1 ] && echo --names) 2>&1 \
             | tee "$OUT/first-update-bits.log" ;;
    rope) python3 benchmarks/rope_bits.py "$OUT/$day-h200-rope-bits.json" --processes "${PROCESSES:-200}" \
            --parallel "${PARALLEL:-2}" 2>&1 | tee "$OUT/rope-bits.log" ;;
    plans) python3 benchmarks/cudnn_plans.py "$OUT/$day-h200-cudnn-plans.json" --processes "${PROCESSES:-96}" \
             --parallel "${PARALLEL:-8}" 2>&1 | cut -c1-400 | tee "$OUT/cudnn-plans.log" ;;
    same) for round in $(seq "${ROUNDS:-3}"); do
            python3 benchmarks/throughput.py "$OUT/same-$round.json" --no-peer ${COMBOS:-llama-3.2-1b:qlora --steps 20} 2>&1
          done | grep "ours" | tee "$OUT/same.log"
          python3 benchmarks/same_bits.py "$OUT"/same-*.json | tee -a "$OUT/same.log" ;;
    replay) python3 benchmarks/replay_bits.py "$OUT/$day-h200-replay-bits.json" ${COMBOS:-llama-3.2-1b:qlora} \
              --replays "${REPLAYS:-50}" 2>&1 | tee "$OUT/replay-bits.log" ;;
    profile) for c in ${PROFILES:-smollm2-135m:lora:eager llama-3.2-1b:lora:eager}; do python3 benchmarks/throughput.py --profile $c; done 2>&1 \
               | tee "$OUT/profile.log" | grep -v "^-" | cut -c1-160 | head -n 90 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
echo "== done $(date +%T)"
