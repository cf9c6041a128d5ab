// Types for ruvllm-web. Requests and chunks follow OpenAI's chat/completions shapes.

import type { SamplingFields } from './request_fields';
export type { SamplingFields };

/** 'auto' (default): WebGPU where the browser has a hardware adapter (a software one, such as SwiftShader,
 *  is passed over), else WASM; 'webgpu' takes any adapter. */
export type Device = 'auto' | 'wasm' | 'webgpu';

export interface LoadProgress {
  stage: 'runtime' | 'model' | 'session' | 'ready';
  /** bytes so far and in all, while stage is 'model' */
  loaded?: number;
  total?: number;
  file?: string;
  /** true when the bytes came from the browser cache */
  cached?: boolean;
  message?: string;
}

export interface CreateEngineOptions {
  /** URL of a model package folder (exported with `python -m exporter convert ... --target wasm`), or a GGUF:
   *  a `.gguf` URL (read in byte ranges), a File (`<input type=file>`), a Blob or an ArrayBuffer. A split GGUF
   *  (llama.cpp's gguf-split, `<name>-00001-of-0000N.gguf`) by its first part's URL, or its parts as Files
   *  (any order when they carry those names). A GGUF runs on the WASM step; the package the page makes of it
   *  is kept in OPFS for the next load. */
  model: string | Blob | ArrayBuffer | Blob[];
  device?: Device;
  /** WASM threads; needs a cross-origin isolated page (COOP/COEP). Default: min(4, cores). */
  threads?: number;
  onProgress?: (progress: LoadProgress) => void;
  /** Base URL of the bundle (default: the folder above this module). */
  assetsURL?: string;
  /** Where pyodide.mjs and its files are served (default: `${assetsURL}pyodide/`). */
  pyodideURL?: string;
  /** Where onnxruntime-web's dist files are served (default: `${assetsURL}ort/`). */
  ortURL?: string;
  /** Where the runtime wheels and pyodide-lock.json are served (default: `${assetsURL}python/`). */
  pythonURL?: string;
  /** KV-cache budget in MB (default 256). */
  kvMemoryMB?: number;
  /** A request whose JSON is larger (UTF-8 bytes) is refused with code 'request_too_large' before it is
   *  parsed; by default 1 KiB a token of the model's context plus 1 MiB, as the server's. */
  maxRequestBytes?: number;
  /** The page's user: their adapter (learned by engine.feedback) serves requests that name no other `user`. */
  user?: string;
  /** The KV cache's numbers: 'fp32' (default), 'int8' rows with an fp16 scale per 32 numbers (about a
   *  quarter of the memory), or 'int4' (Hadamard-rotated 4-bit rows, about a seventh; the WASM step only).
   *  Quantized pools keep the blocks being written exact too, as the native engine does. WASM only. */
  kvDtype?: 'fp32' | 'int8' | 'int4';
  maxNumSeqs?: number;
  /** Tokens one step computes at most (default 128 on the WASM step, whose scratch grows with them; 256 on
   *  onnxruntime-web). */
  maxBatchTokens?: number;
  /** Prompt-lookup drafts verified per decode step of a greedy or low-temperature request (default 3 on
   *  onnxruntime-web, 0 on the WASM step, which pays each draft's full compute; 0 turns speculative decoding off). */
  speculativeTokens?: number;
  /** Keep the last prompt's K/V blocks in the browser's storage (OPFS), so that after a reload a prompt
   *  sharing them (the system prompt at least) skips their prefill (default true). */
  promptCache?: boolean;
  /** The model name reported in responses (default: the manifest's). */
  modelName?: string;
  /** What runs each step: 'onnxruntime' (onnxruntime-web on the package's ONNX graph), 'wasm-step' (the
   *  package's own WASM decode step on its GGUF blocks, wasm/step/step.c, on `threads` threads where the
   *  page is cross-origin isolated; fp32 KV, LoRA but no X-LoRA; the package needs step.bin, written by
   *  `--target wasm` from a GGUF), or 'auto' (default): 'wasm-step' where the package has step.bin, kvDtype
   *  is 'fp32' and the device would be 'wasm' (no hardware WebGPU adapter, or device 'wasm'), else 'onnxruntime'. */
  backend?: 'auto' | 'onnxruntime' | 'wasm-step';
}

export interface ToolCall {
  id: string;
  type: 'function';
  function: { name: string; arguments: string };
}

export interface ChatMessage {
  role: 'system' | 'developer' | 'user' | 'assistant' | 'tool';
  content: string | { type: 'text'; text: string }[] | null;
  /** An assistant turn's calls, sent back with the `tool` messages that answer them. */
  tool_calls?: ToolCall[];
  tool_call_id?: string;
}

export interface FunctionTool {
  type: 'function';
  function: { name: string; description?: string; parameters?: Record<string, unknown>; strict?: boolean };
}

/** As OpenAI: the reply is JSON (any object, or one that fits the schema). */
export type ResponseFormat = { type: 'text' } | { type: 'json_object' } |
  { type: 'json_schema'; json_schema: { name: string; schema?: Record<string, unknown>; strict?: boolean; description?: string } };

/** As vLLM's structured_outputs: exactly one of these. */
export interface StructuredOutputs {
  json?: Record<string, unknown> | string;
  regex?: string;
  choice?: string[];
  grammar?: string;
  json_object?: boolean;
}

/** The sampling fields (temperature, top_p, ..., DRY's) are declared once, in Python, and generated into
 * request_fields.d.ts. */
export interface ChatCompletionRequest extends SamplingFields {
  messages: ChatMessage[];
  model?: string;
  stream?: boolean;
  stream_options?: { include_usage?: boolean };
  max_tokens?: number;
  max_completion_tokens?: number;
  /** Choices to generate (1-128); streamed chunks carry their choice's `index`. With a seed, choice i uses seed + i. */
  n?: number;
  stop?: string | string[];
  logit_bias?: Record<string, number>;
  logprobs?: boolean;
  top_logprobs?: number;
  /** Extension (as in vLLM): each choice also carries its generated token ids. */
  return_token_ids?: boolean;
  /** As vLLM: generate past end-of-sequence tokens; token ids that end a choice; keep the matched stop string. */
  ignore_eos?: boolean;
  stop_token_ids?: number[];
  include_stop_str_in_output?: boolean;
  /** DRY (llama.cpp's repetition sampler): the texts that end a repeat (default newline, colon, quote, asterisk). */
  dry_sequence_breakers?: string[];
  /** Structured output, enforced token by token (a keyword the page cannot enforce is an error naming it). */
  response_format?: ResponseFormat;
  structured_outputs?: StructuredOutputs;
  tools?: FunctionTool[];
  tool_choice?: 'none' | 'auto' | 'required' | { type: 'function'; function: { name: string } };
  parallel_tool_calls?: boolean;
  /** As vLLM: the chat template's own variables, such as Qwen3's `{ enable_thinking: false }`. */
  chat_template_kwargs?: Record<string, unknown>;
  /** As llama.cpp's server: a reasoning model's thinking block is closed after this many tokens. */
  thinking_budget_tokens?: number;
  /** Informational (as OpenAI): accepted, they change nothing generated. */
  user?: string;
  metadata?: Record<string, string>;
  /** Aborts the request when signalled. */
  signal?: AbortSignal;
}

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
  prompt_tokens_details: { cached_tokens: number };
  /** A reasoning model's: the tokens of its thinking blocks. */
  completion_tokens_details?: { reasoning_tokens: number };
}

export interface ChatCompletion {
  id: string;
  object: 'chat.completion';
  created: number;
  model: string;
  choices: {
    index: number;
    /** A reasoning model's thinking is in `reasoning` (and `reasoning_content`, its older name), never in `content`. */
    message: { role: 'assistant'; content: string | null; refusal: null; tool_calls?: ToolCall[];
      reasoning?: string | null; reasoning_content?: string | null };
    logprobs: unknown | null;
    finish_reason: 'stop' | 'length' | 'tool_calls' | null;
    token_ids?: number[];
  }[];
  usage: Usage;
}

export interface ChatCompletionChunk {
  id: string;
  object: 'chat.completion.chunk';
  created: number;
  model: string;
  choices: {
    index: number;
    delta: { role?: 'assistant'; content?: string; reasoning?: string; reasoning_content?: string;
      tool_calls?: { index: number; id?: string; type?: 'function'; function: { name?: string; arguments?: string } }[] };
    logprobs: unknown | null;
    finish_reason: 'stop' | 'length' | 'tool_calls' | null;
    token_ids?: number[];
  }[];
  usage?: Usage;
}

export interface ChunkStream extends AsyncIterable<ChatCompletionChunk> {
  /** The request's id: engine.abort(id) stops it, as abort() does. */
  readonly id: number;
  /** Stop generating; the stream ends with finish_reason "stop". */
  abort(): Promise<boolean>;
}

/** A text prompt (OpenAI's completions): a base model's request, one without a chat template. */
export type CompletionRequest = Omit<ChatCompletionRequest, 'messages' | 'tools' | 'tool_choice' | 'logprobs' | 'top_logprobs'> & {
  /** A prompt (text or token ids), or several: prompt k's choices are k * n .. k * n + n - 1. */
  prompt: string | number[] | string[] | number[][];
  /** Alternatives per token in the legacy logprobs (0-20). */
  logprobs?: number;
  /** Each choice starts with its prompt's text, and with logprobs its prompt tokens' (the first null). */
  echo?: boolean;
  /** As vLLM: each choice also carries its prompt's log-probabilities, with this many alternatives (0-20). */
  prompt_logprobs?: number;
};

/** Legacy (completions) log-probabilities; with echo the prompt's tokens come first, the first null. */
export interface CompletionLogprobs {
  tokens: string[];
  token_logprobs: (number | null)[];
  top_logprobs: (Record<string, number> | null)[];
  text_offset: number[];
}

export interface Completion {
  id: string;
  object: 'text_completion';
  created: number;
  model: string;
  choices: { index: number; text: string; logprobs: CompletionLogprobs | null; finish_reason: 'stop' | 'length' | null;
    token_ids?: number[];
    prompt_logprobs?: (Record<string, { logprob: number; rank?: number; decoded_token: string }> | null)[] }[];
  usage: Usage;
}

export interface CompletionChunk {
  id: string;
  object: 'text_completion';
  created: number;
  model: string;
  choices: { index: number; text: string; logprobs: unknown | null; finish_reason: 'stop' | 'length' | null }[];
  usage?: Usage;
}

export interface CompletionStream extends AsyncIterable<CompletionChunk> {
  readonly id: number;
  abort(): Promise<boolean>;
}

export interface EngineInfo {
  model: string;
  /** what runs each step (options.backend, 'auto' resolved) */
  backend: 'onnxruntime' | 'wasm-step';
  device: 'wasm' | 'webgpu';
  /** the package's graph file in use (a --target wasm package has a WebGPU variant) */
  graph: string;
  /** the GGUF's file name when `model` was a GGUF the page opened itself, else null */
  gguf: string | null;
  threads: number;
  /** the KV cache's numbers (options.kvDtype) */
  kvDtype: 'fp32' | 'int8' | 'int4';
  crossOriginIsolated: boolean;
  quantization: Record<string, unknown>;
  cache: { fromCache: number; downloaded: number; refetched: number };
  /** 'snapshot': Python restored from the bundle's memory snapshot; 'booted': started and installed afresh */
  python: 'snapshot' | 'booted';
  /** K/V blocks of the last session's last prompt, restored from storage (a prompt sharing them skips their prefill) */
  restoredPromptBlocks: number;
  loadSeconds: number;
  fetchSeconds: number;
  /** What a request gets for the sampling fields it leaves out: the model's own generation settings,
   * else chat defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05). */
  sampling: { temperature: number; top_k?: number; top_p?: number; min_p?: number; repetition_penalty?: number };
  /** Whether a request's tokens never depend on what runs beside it: the WASM step computes every token
   * alike in any step; onnxruntime-web's kernels make no such promise (batchInvariance says so). */
  batchInvariant: boolean;
  batchInvariance?: string;
}

export interface EngineStats {
  running: number;
  waiting: number;
  kv_blocks_total: number;
  kv_blocks_used: number;
  kv_blocks_free: number;
  prefix_cache_hits: number;
  prefix_cache_hit_rate: number;
  prompt_tokens: number;
  cached_prompt_tokens: number;
  generated_tokens: number;
  aborted: number;
  peak_running: number;
  [key: string]: unknown;
}

export type AdapterSource = string | URL | Record<string, ArrayBuffer | ArrayBufferView | Blob>;

export interface AdapterInfo {
  name: string;
  kind: 'peft' | 'ruvllm' | 'xlora';
  rank: number;
  targets: string[];
  /** X-LoRA: its experts' names */
  experts: string[] | null;
  /** Where the weights with a sha256 in their adapter.json (the exporter's format) came from; PEFT folders
   * name no hashes and are fetched each time. */
  cache: { downloaded: number; fromCache: number; refetched: number };
}

export interface Engine {
  readonly info: EngineInfo;
  chat: {
    completions: {
      create(request: ChatCompletionRequest & { stream: true }): Promise<ChunkStream>;
      create(request: ChatCompletionRequest & { stream?: false }): Promise<ChatCompletion>;
    };
  };
  /** A text prompt continued (a base model without a chat template: Gemma 3 270M's GGUF). */
  completions: {
    create(request: CompletionRequest & { stream: true }): Promise<CompletionStream>;
    create(request: CompletionRequest & { stream?: false }): Promise<Completion>;
  };
  /** Abort one request (a stream's id) or, with no argument, every request in flight. */
  abort(id?: number): Promise<boolean>;
  stats(): Promise<EngineStats>;
  /**
   * Serve a LoRA adapter under `name` (requests pick it with `model: name`): the URL of its folder
   * (PEFT's adapter_config.json + adapter_model.safetensors, or `python -m exporter adapter`'s
   * adapter.json + adapter.safetensors), or its files by name. A PEFT X-LoRA folder also needs its
   * expert adapters, by the names its adapter_config.json gives them.
   */
  loadAdapter(name: string, source: AdapterSource, options?: { experts?: Record<string, AdapterSource> }): Promise<AdapterInfo>;
  /** Stop serving an adapter: new requests naming it fail with model_not_found; running ones finish. */
  unloadAdapter(name: string): Promise<boolean>;
  /**
   * Teach a user (the engine's `user`, or the body's) from one feedback: their own text, the answer they
   * preferred, or a rated answer. Their next requests are served what was learned; it survives a reload.
   */
  feedback(body: FeedbackRequest): Promise<FeedbackResult>;
  /** Reset a user (by default the engine's): the base model serves them again. */
  forget(user?: string): Promise<boolean>;
  /** What a user (by default the engine's) has learned. */
  userState(user?: string): Promise<UserState>;
  /** A user's (by default the engine's) adapter as PEFT's files, to train further elsewhere; null before
   *  they have learned anything. */
  userAdapter(user?: string): Promise<Record<string, Uint8Array> | null>;
  /** Stop the worker and free the model. */
  unload(): Promise<void>;
}

export type FeedbackRequest = { user?: string; model?: string } & (
  | { text: string }
  | { messages: ChatMessage[]; preferred: string }
  | { messages: ChatMessage[]; completion: string; rating: number });

export interface FeedbackResult {
  object: 'feedback';
  user: string;
  kind: 'text' | 'preferred' | 'rating';
  tokens: number;
  steps: number;
  losses: number[];
  version: number;
  feedbacks: number;
  consolidated: boolean;
  seconds: number;
  learn_seconds: number;
  model: string;
}

export interface UserState {
  object: 'user';
  user: string;
  version: number;
  feedbacks: number;
  tokens: number;
  targets: string[];
  rank: number;
}

export function createEngine(options: CreateEngineOptions): Promise<Engine>;

/** A GGUF's package the page made and kept in this browser (OPFS and the Cache API). */
export interface KeptModel {
  /** what createEngine's `model` was: the GGUF's URL, or a file's key (`file:name:size:modified`) */
  source: string;
  name: string;
  /** the package's bytes in storage */
  bytes: number;
  /** the kept package's own URL (pass it to forgetModel; createEngine opens it too) */
  url: string;
}

/** The GGUFs' packages kept in this browser. */
export function keptModels(): Promise<KeptModel[]>;

/** Delete a kept GGUF package (its files and manifest); true when there was one. */
export function forgetModel(url: string): Promise<boolean>;
