"""The benchmarks behind docs/benchmarks.md, in page order: each report file, its heading, the
command that writes it into build/reports/ and what its table shows (report_benchmarks.py
renders them; `make benchmarks` runs the commands)."""

Q4_BENCH = ("dsrun bench --model build/smollm2-q4.dsmodel --prompts "
            "samples/prompts/peer_prompts.jsonl --max-tokens 128 --repeats 4")
Q8_BENCH = ("dsrun bench --model build/smollm2-q8.dsmodel --prompts "
            "samples/prompts/peer_prompts.jsonl --max-tokens 128 --repeats 4")
AVX2 = "DSPARK_CPU_ISA=avx2 DSPARK_CPU_MARCH=haswell "  # MatMulInt4 and attention for AVX2
# (report file, heading, the command that writes it, what the table shows)
REPORTS = [
    ("peers_greedy.json", "Against onnxruntime-genai and llama.cpp, greedy",
     "python bench/bench_peers.py --repeats 3 --json build/reports/peers_greedy.json",
     "tok/s per class (12 unseen prompts: 4 code, 4 chat, 4 edits; 128 new tokens), and "
     "ratios to the system's own plain mode, to dsrun's fp32 plain decoding, to the fastest "
     "onnxruntime-genai mode and to the fastest lossless llama.cpp mode on weights of the "
     "same precision. `same`: every greedy output equals its own plain mode's. Whole runs "
     "move too: two runs of the same code (0d457b9 and a8221df differ in docs only), 25 "
     "minutes apart, measured the fp32 sample's default at 1.69 / 1.77 / 1.66x its own plain "
     "(1.60 / 1.59 / 1.29x the best llama.cpp mode) and at "
     "2.00 / 2.08 / 1.85x (1.92 / 1.94 / 1.53x); the first is not a slower revision "
     "(`bench_revisions.py e14cba3` the same hour: new/old 0.98-1.04)."),
    ("peers_sampled.json", "Against onnxruntime-genai and llama.cpp, temperature 0.7",
     "python bench/bench_peers.py --repeats 3 --temperature 0.7 "
     "--json build/reports/peers_sampled.json",
     "As above, each system sampling its own outputs; the ratio to its own plain mode comes "
     "with a 90% bootstrap interval over the (prompt, seed) pairs."),
    ("peers_loaded.json", "With one core busy with other work",
     "python bench/bench_peers.py --repeats 2 --background-load --systems dsrun-fp32-plain "
     "dsrun-fp32-default dsrun-q4-plain dsrun-q4-default dsrun-genai4-plain dsrun-genai4-default "
     "dsrun-q4-plain#2 dsrun-q4-default#2 --json build/reports/peers_loaded.json",
     "Another process spins on one of the two cores for the whole run: speculation must not "
     "lose to plain decoding then either. `#2`: a second process of the same system, beside "
     "the first: two processes of one system differ by several percent under such a load, "
     "which bounds what one pair's ratio can show."),
    ("peers_quiet_one.json", "The int4 bundles' modes in one process",
     "python bench/bench_peers.py --repeats 4 --one-process --systems dsrun-q4-plain "
     "dsrun-q4-default dsrun-genai4-plain dsrun-genai4-default dsrun-q4-plain#2 "
     "dsrun-q4-default#2 --json build/reports/peers_quiet_one.json",
     "One process serves both modes of a bundle, each request naming its mode (a server's "
     "clients turning speculation on and off per request), so the ratio to plain is "
     "speculation's own, without the spread between processes; a 90% bootstrap interval "
     "over the paired calls. `#2`: a second such process."),
    ("peers_avx2_one.json", "The int4 bundles' modes in one process, AVX2 path",
     "DSPARK_CPU_ISA=avx2 DSPARK_CPU_MARCH=haswell python bench/bench_peers.py --repeats 4 "
     "--one-process --systems dsrun-q4-plain dsrun-q4-default dsrun-genai4-plain "
     "dsrun-genai4-default dsrun-q4-plain#2 dsrun-q4-default#2 "
     "--json build/reports/peers_avx2_one.json",
     "As above, MatMulInt4 and the attention on their AVX2 paths."),
    ("peers_loaded_one.json", "One core busy, each bundle's modes in one process",
     "python bench/bench_peers.py --repeats 4 --background-load --one-process --systems "
     "dsrun-q4-plain dsrun-q4-default dsrun-genai4-plain dsrun-genai4-default "
     "dsrun-q4-plain#2 dsrun-q4-default#2 "
     "--json build/reports/peers_loaded_one.json",
     "Another process spins on one of the two cores for the whole run; each bundle's two "
     "modes in one process with the interval, as in the two sections above (a busy core "
     "moves one call's speed against the next one's). `#2`: a second such process."),
    ("int4_kernels.json", "MatMulInt4's paths against onnxruntime's MatMulNBits",
     "python bench/bench_int4.py --json build/reports/int4_kernels.json",
     "Microseconds per projection of SmolLM2's shapes (median of interleaved runs), each "
     "MatMulInt4 path this CPU runs and MatMulNBits with each zero-point form; the ratio is to "
     "MatMulNBits symmetric."),
    ("peers_avx2.json", "dsrun on its AVX2 path",
     "DSPARK_CPU_ISA=avx2 DSPARK_CPU_MARCH=haswell python bench/bench_peers.py --repeats 4 "
     "--systems dsrun-fp32-plain dsrun-fp32-default dsrun-q4-plain dsrun-q4-default "
     "llama-q4_1-plain llama-q4_1-ngram --json build/reports/peers_avx2.json",
     "MatMulInt4 forced to its AVX2 path and the attention built for AVX2, beside llama.cpp "
     "built for AVX2 without AVX-512 on the same Q4_1 weights: what an AVX2-only CPU runs "
     "(onnxruntime's own kernels, in the fp32 main, keep the CPU's best)."),
    ("peers_loaded_avx2.json", "dsrun on its AVX2 path, one core busy",
     "DSPARK_CPU_ISA=avx2 DSPARK_CPU_MARCH=haswell python bench/bench_peers.py --repeats 2 "
     "--background-load --systems dsrun-fp32-plain dsrun-fp32-default dsrun-q4-plain "
     "dsrun-q4-default dsrun-q4-plain#2 dsrun-q4-default#2 "
     "--json build/reports/peers_loaded_avx2.json",
     "Both at once: the AVX2 path and another process spinning on one core (`#2`: a second "
     "process of the same system)."),
    ("peers_loaded_avx2_one.json", "dsrun on its AVX2 path, one core busy, modes in one process",
     "DSPARK_CPU_ISA=avx2 DSPARK_CPU_MARCH=haswell python bench/bench_peers.py --repeats 4 "
     "--background-load --one-process --systems dsrun-q4-plain dsrun-q4-default "
     "dsrun-genai4-plain dsrun-genai4-default dsrun-q4-plain#2 dsrun-q4-default#2 "
     "--json build/reports/peers_loaded_avx2_one.json",
     "The AVX2 path under load, each bundle's two modes in one process, the interval as in "
     "the AVX-512 one-process section (`#2`: a second such "
     "process)."),
    ("peers_int4off.json", "Without MatMulInt4: onnxruntime's kernels",
     "DSPARK_CPU_INT4=0 python bench/bench_peers.py --repeats 2 --systems dsrun-fp32-plain "
     "dsrun-fp32-default dsrun-q4-plain dsrun-q4-default llama-q4_1-plain "
     "--json build/reports/peers_int4off.json",
     "What a CPU without MatMulInt4's vector paths (or without a C compiler) runs: the int4 "
     "projections on onnxruntime's MatMulNBits, dsc quantize's float zero points split onto "
     "its symmetric kernel (runtime/model/zero_points.py); the fp32 sample's draft and the q4 "
     "main both. onnxruntime's own kernels keep this CPU's best path."),
    ("q4_bench.json", "The int4 main in one process",
     Q4_BENCH + " --json > build/reports/q4_bench.json",
     "The q4 bundle (the main on the GGUF's grid, lookup drafting only) on the 12 peer "
     "prompts, default speculation and plain decoding interleaved per prompt in one process "
     "(no noise between worker processes; single runs still vary by a few percent)."),
    ("q4_bench_loaded.json", "The int4 main in one process, one core busy",
     Q4_BENCH + " --background-load --json > build/reports/q4_bench_loaded.json",
     "The same, another process spinning on one core while it measures."),
    ("q4_bench_avx2.json", "The int4 main in one process, on its AVX2 path",
     AVX2 + Q4_BENCH + " --json > build/reports/q4_bench_avx2.json",
     "The same with MatMulInt4 on its AVX2 path, where a verify of several tokens costs the "
     "most (performance.md)."),
    ("q4_bench_avx2_loaded.json",
     "The int4 main in one process, on its AVX2 path, one core busy",
     AVX2 + Q4_BENCH + " --background-load --json > build/reports/q4_bench_avx2_loaded.json",
     "Both at once."),
    ("q8_bench.json", "The int8 main (onnxruntime's quantize_dynamic) in one process",
     "python samples/int8_sample.py && " + Q8_BENCH + " --json > build/reports/q8_bench.json",
     "The sample's main through quantize_dynamic (int8 weights per column, activations "
     "quantized at run time, compiled per token: models.md) with the sample's int4 draft, "
     "default speculation and plain decoding interleaved per prompt in one process."),
    ("peers_threads_loaded.json", "One thread against two, one core busy",
     "python bench/bench_peers.py --repeats 2 --background-load --systems dsrun-q4-plain "
     "dsrun-q4-default dsrun-q4-plain@t1 dsrun-q4-default@t1 dsrun-fp32-plain "
     "dsrun-fp32-default dsrun-fp32-plain@t1 dsrun-fp32-default@t1 "
     "--json build/reports/peers_threads_loaded.json",
     "`@t1`: that worker at DSPARK_THREADS=1, beside the same system at the core count, with "
     "another process spinning on one core (see performance.md: with other work on the "
     "cores, set DSPARK_THREADS to the cores it leaves free)."),
    ("peers_threads.json", "One thread against two, cores free",
     "python bench/bench_peers.py --repeats 2 --systems dsrun-q4-plain dsrun-q4-default "
     "dsrun-q4-plain@t1 dsrun-q4-default@t1 dsrun-fp32-plain dsrun-fp32-default "
     "dsrun-fp32-plain@t1 dsrun-fp32-default@t1 --json build/reports/peers_threads.json",
     "The same systems on a quiet machine."),
    ("peers_threads_auto.json", "DSPARK_THREADS=auto beside a steady load",
     "python bench/bench_peers.py --repeats 2 --load-from-start --systems dsrun-q4-plain "
     "dsrun-q4-default dsrun-q4-plain@tauto dsrun-q4-default@tauto dsrun-fp32-plain "
     "dsrun-fp32-default dsrun-fp32-plain@tauto dsrun-fp32-default@tauto "
     "--json build/reports/peers_threads_auto.json",
     "Another process spins on one core from before the systems start; `@tauto`: that worker "
     "at DSPARK_THREADS=auto (it measures the load at start and takes the free cores), "
     "beside the same system at the core count."),
    ("peers_threads_fixed_loaded.json",
     "A load arriving after start: the default against a fixed pool",
     "python bench/bench_peers.py --repeats 2 --background-load --systems dsrun-q4-plain "
     "dsrun-q4-default dsrun-q4-plain@t2 dsrun-q4-default@t2 dsrun-genai4-plain "
     "dsrun-genai4-default dsrun-fp32-plain dsrun-fp32-default "
     "--json build/reports/peers_threads_fixed_loaded.json",
     "Another process starts spinning on one core after the systems have loaded and warmed "
     "up. The default (DSPARK_THREADS unset) runs our ops on the calling thread while the load "
     "lasts (performance.md); `@t2`: that worker at DSPARK_THREADS=2, every forward on the "
     "pool, as the default did before."),
    ("peers_threads_adaptive_loaded.json", "DSPARK_THREADS=adaptive, a load arriving after start",
     "python bench/bench_peers.py --repeats 2 --background-load --systems dsrun-q4-plain "
     "dsrun-q4-default dsrun-q4-plain@tadaptive dsrun-q4-default@tadaptive dsrun-fp32-plain "
     "dsrun-fp32-default dsrun-fp32-plain@tadaptive dsrun-fp32-default@tadaptive "
     "--json build/reports/peers_threads_adaptive_loaded.json",
     "Another process starts spinning on one core after the systems have loaded and warmed "
     "up; `@tadaptive`: that worker at DSPARK_THREADS=adaptive (each forward leaves the pool "
     "while the load lasts, performance.md), beside the same system at the core count."),
    ("peers_threads_adaptive.json", "DSPARK_THREADS=adaptive, cores free",
     "python bench/bench_peers.py --repeats 2 --systems dsrun-q4-plain dsrun-q4-default "
     "dsrun-q4-plain@tadaptive dsrun-q4-default@tadaptive dsrun-fp32-plain dsrun-fp32-default "
     "dsrun-fp32-plain@tadaptive dsrun-fp32-default@tadaptive "
     "--json build/reports/peers_threads_adaptive.json",
     "The same systems on a quiet machine: what the mode costs where no load comes."),
    ("peers_optimum.json", "optimum's export of SmolLM2",
     "python bench/bench_peers.py --repeats 2 --systems dsrun-optimum-plain "
     "dsrun-optimum-default dsrun-fp32-plain dsrun-fp32-default genai-fp32-plain "
     "genai-fp32-ngram --json build/reports/peers_optimum.json",
     "optimum-cli's export of the same SmolLM2 weights compiled by dsc (with the sample's "
     "draft), beside the sample bundle our recipe exports and onnxruntime-genai's fp32 build."),
    ("peers_gemma3.json", "Gemma 3 270M against onnxruntime-genai",
     "python bench/bench_peers.py --model gemma3 --repeats 2 "
     "--json build/reports/peers_gemma3.json",
     "The Gemma 3 sample and onnxruntime-genai's fp32 build of the same weights (also compiled "
     "by dsc), on the base-model prompts of samples/prompts/base_prompts.jsonl, 128 new tokens, "
     "interleaved; ratios to each system's own plain mode and to genai's fastest mode."),
    ("multi_turn.json", "Multi-turn chats under shared system prompts",
     "python bench/bench_multi_turn.py --json build/reports/multi_turn.json",
     "TTFT of a user's first turn when its system prompt is new to the server (cold) or "
     "another user brought it (shared), and of later turns (warm); the share of prompt "
     "tokens taken from a cache; output tok/s of the whole workload. dsrun with its prefix "
     "cache and without (`--no-prefix-cache`), llama-server with `cache_prompt` on and as "
     "many slots as users at once; the same weights and the same conversations."),
    ("prefix_lookup.json", "Prefix cache",
     "python bench/bench_prefix_lookup.py --json build/reports/prefix_lookup.json",
     "What a lookup costs, and what the last partial block of a prompt costs a warm turn "
     "when it is computed again (the fp32 sample at 4096 positions): why the prefix cache "
     "matches that block token by token (docs/runtime.md)."),
    ("kv_bytes_gemma3.json", "KV memory one Gemma 3 sequence holds at 8192 positions",
     "python bench/kv_bytes.py --bundle build/gemma3-8k.dsmodel --tokens 8192 "
     "--json build/reports/kv_bytes_gemma3.json",
     "The Gemma 3 sample compiled at 8192 positions (`dsc compile ... --max-seq-len 8192`): "
     "15 of its 18 layers attend to a window of 512. One sequence is fed to its last "
     "position and the blocks it holds are counted (a count, not a timing)."),
    ("processors.json", "Penalties and logprobs",
     "python bench/bench_processors.py --json build/reports/processors.json",
     "The sample on the peer prompts, greedy, one request at a time, every mode in turn: "
     "plain and default speculation without and with penalties (presence 0.5, frequency "
     "0.3, repetition 1.1, a logit_bias), and default with logprobs (5 top ones a token). "
     "Speculation keeps its speed-up under penalties; logprobs' cost is default+logprobs "
     "against default (noise is a few percent either way)."),
    ("serving.json", "Serving under load: 1 to 64 streaming clients",
     "python bench/bench_serving.py --json build/reports/serving.json",
     "N streaming clients sending the held-out chat prompts back to back (128 tokens, "
     "greedy, `cache_prompt: false`: every request pays its whole prompt, as distinct "
     "users' prompts would) for 60 s per setting, in three interleaved rounds (each round's "
     "tok/s in brackets: their spread is the noise a ratio carries); dsrun plain and default "
     "(--max-batch 16 --max-queue 32) beside llama-server with 16 slots on the same weights. "
     "ITL is each request's mean time per token after its first. A 429 is retried as the "
     "OpenAI SDK retries it (the same request after retry-after-ms, at most twice), and a "
     "client whose wait would pass the setting's end stops there: `calls "
     "refused` failed all three attempts, `call TTFT` counts from a call's first attempt, "
     "and `fewest requests` is the fewest any one client had served. `same as alone`: "
     "every greedy text under load equals the same prompt's at one client "
     "(docs/serving.md)."),
    ("roofline.json", "One client against the memory ceiling",
     "python bench/bench_roofline.py --json build/reports/roofline.json",
     "A decode step streams every weight once, so no engine decodes faster than the "
     "machine's read bandwidth over the bytes it reads per token (its ceiling). Bandwidth: "
     "bench/read_bandwidth.c, every core reading its share of 1 GiB, best of 5; bytes: "
     "dsrun's main as `dsrun bench --profile` counts them, llama.cpp's whole GGUF (SmolLM2's "
     "head is its embedding table); decode: dsrun's main forward at 128 cached tokens plus "
     "its engine's time per token, llama-server's predicted_per_token_ms (one slot, 64 "
     "tokens after a ~100-token prompt); three interleaved rounds, medians."),
    ("big.json", "At 1B parameters: compile, verify, load, speculation",
     "python bench/bench_big.py --json build/reports/big.json --load-repeats 5",
     "samples/big_pair.py's random-init 1.2B Llama (TinyLlama-1.1B's shape, SmolLM2's "
     "tokenizer) and a draft of its first two layers: bundle a is the fp32 main with the int4 "
     "draft, b the int4 main with it. Peak RSS is the whole process tree's, sampled every "
     "0.5 s (bench/rss_watch.py); a first load hashes every file and measures the cost "
     "table, a second finds both remembered (docs/bundle.md). Random weights: the costs are "
     "real, the text is not, and acceptance comes from damping the upper layers. The loads "
     "alone are measured again by the same command with --loads-only."),
    ("gemma3_bench.json", "Gemma 3 270M: speculation against plain decoding",
     "dsrun bench --model build/gemma3.dsmodel --prompts samples/prompts/base_prompts.jsonl "
     "--repeats 2 --json > build/reports/gemma3_bench.json",
     "The Gemma 3 sample (fp32 main, its 4-bit copy as draft, sliding windows of 512; a base "
     "model: plain-text prompts, 4 open questions and stories, 4 functions to write)."),
]
