// A consumer of ruvllm-web's published types: every exported function and type is used here, and
// `tsc --noEmit` (tests/web/test_types.py) must accept it.
import {
  createEngine, type AdapterInfo, type AdapterSource, type ChatCompletion, type ChatCompletionChunk, type ChatCompletionRequest, type ChatMessage,
  type ChunkStream, type Completion, type CompletionChunk, type CompletionRequest, type CompletionStream,
  type CreateEngineOptions, type Device, type Engine, type EngineInfo, type EngineStats,
  type FunctionTool, type LoadProgress, type ResponseFormat, type StructuredOutputs, type ToolCall, type Usage,
} from 'ruvllm-web';

const device: Device = 'auto';
const onProgress = (p: LoadProgress): void => { console.log(p.stage, p.loaded ?? 0, p.total ?? 0, p.cached ?? false); };
const options: CreateEngineOptions = { model: '/models/smollm2-135m/', device, threads: 2, onProgress, kvMemoryMB: 256,
  maxNumSeqs: 16, maxBatchTokens: 256, speculativeTokens: 0, promptCache: true, modelName: 'smol', kvDtype: 'int8',
  backend: 'onnxruntime' };

export async function main(): Promise<void> {
  const engine: Engine = await createEngine(options);
  const info: EngineInfo = engine.info;
  const kv: 'fp32' | 'int8' | 'int4' = info.kvDtype;
  const backend: 'onnxruntime' | 'wasm-step' = info.backend;
  const messages: ChatMessage[] = [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: [{ type: 'text', text: 'Hi' }] }];
  const request = { messages, max_tokens: 8, temperature: 0, top_k: -1, stop: ['\n'], seed: 1,
    logit_bias: { '42': -100 }, return_token_ids: true, ignore_eos: false, stop_token_ids: [2], user: 'u' } satisfies ChatCompletionRequest;
  const whole: ChatCompletion = await engine.chat.completions.create(request);
  const usage: Usage = whole.usage;
  const text: string = whole.choices[0].message.content ?? '';
  const format: ResponseFormat = { type: 'json_schema', json_schema: { name: 'n', schema: { type: 'object' }, strict: true } };
  const outputs: StructuredOutputs = { regex: '[0-9]+' };
  const tool: FunctionTool = { type: 'function', function: { name: 'get_weather', parameters: { type: 'object' } } };
  const called = await engine.chat.completions.create({ messages, response_format: format, tools: [tool],
    tool_choice: 'required', parallel_tool_calls: false });
  const calls: ToolCall[] = called.choices[0].message.tool_calls ?? [];
  await engine.chat.completions.create({ messages: [...messages, { role: 'assistant', content: null, tool_calls: calls },
    { role: 'tool', content: '{}', tool_call_id: calls[0]?.id }], structured_outputs: outputs });
  const stream: ChunkStream = await engine.chat.completions.create({ ...request, stream: true });
  const id: number = stream.id;
  for await (const chunk of stream) {
    const c: ChatCompletionChunk = chunk;
    if (c.choices[0]?.delta.content) await stream.abort();
  }
  await engine.abort(id);
  const textRequest = { prompt: 'Once upon a time', max_tokens: 8, temperature: 0 } satisfies CompletionRequest;
  const continued: Completion = await engine.completions.create(textRequest);
  const more: string = continued.choices[0].text;
  const scored = await engine.completions.create({ prompt: [[1, 2, 3], [4, 5]], echo: true, logprobs: 1, max_tokens: 0,
    prompt_logprobs: 2 });
  const first: number | null = scored.choices[0].logprobs?.token_logprobs[0] ?? null;
  const alternatives = scored.choices[1].prompt_logprobs?.[1];
  if (first === null && alternatives) await engine.abort(Object.keys(alternatives).length);
  const textStream: CompletionStream = await engine.completions.create({ ...textRequest, stream: true });
  for await (const chunk of textStream) {
    const c: CompletionChunk = chunk;
    if (c.choices[0]?.text === more) await textStream.abort();
  }
  const adapter: AdapterInfo = await engine.loadAdapter('mine', '/adapters/mine/');
  const source: AdapterSource = { 'adapter_config.json': new Uint8Array(2) };
  const mixed: AdapterInfo = await engine.loadAdapter('mixed', '/adapters/xlora/', { experts: { '0': source } });
  console.log(mixed.kind, mixed.experts?.length);
  await engine.chat.completions.create({ messages, model: adapter.name });
  const unloaded: boolean = await engine.unloadAdapter('mine');
  const stats: EngineStats = await engine.stats();
  console.log(info.device, kv, backend, usage.total_tokens, text, stats.running, stats.kv_blocks_used, unloaded);
  await engine.unload();
}
