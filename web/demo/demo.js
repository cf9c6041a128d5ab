// The demo page: a chat with streaming, stop, settings, load progress and live speed numbers.
import { createEngine, forgetModel, keptModels } from './ruvllm/index.js';

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const state = { engine: null, history: [], stream: null, busy: false };
window.ruvllm = state; // for tests and the console

function setStatus(kind, text) {
  $('status').dataset.state = kind;
  $('status-text').textContent = text;
}

function addMessage(role, text = '') {
  $('welcome').hidden = true;
  const row = document.createElement('div');
  row.className = `msg ${role}`;
  const col = document.createElement('div');
  const bubble = document.createElement('div');
  bubble.className = 'bubble';
  bubble.textContent = text;
  const meta = document.createElement('div');
  meta.className = 'meta';
  col.append(bubble, meta);
  row.append(col);
  $('messages').append(row);
  $('chat').scrollTop = $('chat').scrollHeight;
  return { bubble, meta };
}

function setBusy(busy) {
  state.busy = busy;
  $('send').disabled = busy || !state.engine;
  $('input').disabled = !state.engine;
  $('stop').hidden = !busy;
  $('send').hidden = busy;
  setStatus(busy ? 'busy' : 'ready', busy ? 'generating…' : 'ready');
}

async function send(text) {
  if (!text.trim() || state.busy || !state.engine) return;
  $('input').value = '';
  addMessage('user', text);
  state.history.push({ role: 'user', content: text });
  const system = $('system').value.trim();
  const messages = system ? [{ role: 'system', content: system }, ...state.history] : [...state.history];
  const { bubble, meta } = addMessage('assistant');
  bubble.classList.add('streaming');
  setBusy(true);
  const started = performance.now();
  let first = null, reply = '', thought = '', tokens = 0, usage = null;
  const thinking = document.createElement('div'); // a reasoning model's thinking, dimmed above its answer
  thinking.className = 'thinking';
  const answer = document.createTextNode('');
  try {
    state.stream = await state.engine.chat.completions.create({
      messages, stream: true, stream_options: { include_usage: true }, model: $('adapter').value || undefined,
      temperature: Number($('temperature').value), max_tokens: Number($('max-tokens').value),
      ...($('dry').checked ? { dry_multiplier: 0.8 } : {}),
    });
    for await (const chunk of state.stream) {
      if (chunk.usage) usage = chunk.usage;
      const d = chunk.choices?.[0]?.delta, delta = d?.content, think = d?.reasoning ?? d?.reasoning_content;
      if (!delta && !think) continue;
      first ??= performance.now();
      tokens++;
      if (think) {
        thought += think;
        thinking.textContent = thought;
      }
      if (delta) reply += delta;
      answer.textContent = reply;
      if (!bubble.contains(answer)) bubble.replaceChildren(...(thought ? [thinking] : []), answer);
      else if (thought && !bubble.contains(thinking)) bubble.prepend(thinking);
      const secs = (performance.now() - first) / 1000;
      $('m-ttft').textContent = `${((first - started) / 1000).toFixed(2)} s`;
      if (secs > 0 && tokens > 1) $('m-speed').textContent = `${((tokens - 1) / secs).toFixed(1)} tok/s`;
      $('chat').scrollTop = $('chat').scrollHeight;
    }
  } catch (err) {
    bubble.parentElement.parentElement.classList.add('error');
    bubble.textContent = `Error: ${err.message}`;
  } finally {
    bubble.classList.remove('streaming');
    state.stream = null;
    setBusy(false);
  }
  if (usage) {
    $('m-tokens').textContent = `${usage.prompt_tokens} in / ${usage.completion_tokens} out`;
    $('m-cached').textContent = `${usage.prompt_tokens_details?.cached_tokens ?? 0} tokens`;
    const speed = $('m-speed').textContent;
    meta.textContent = `${usage.completion_tokens} tokens · ${speed} · TTFT ${$('m-ttft').textContent}`;
    state.lastUsage = usage;
  }
  state.history.push({ role: 'assistant', content: reply });
  $('input').focus();
}

async function main() {
  const models = await (await fetch('models.json')).json().catch(() => ({ models: [] }));
  const model = params.get('model') ?? models.models?.[0]?.url;
  showKept();
  if (!model) {
    setStatus('error', 'no model in this bundle: open a GGUF');
    return;
  }
  await loadModel(model);
}

// The models this browser keeps (GGUFs the page opened), each with its size, to open again or delete
async function showKept() {
  const kept = await keptModels().catch(() => []);
  $('kept').replaceChildren(...kept.map((k) => {
    const li = document.createElement('li');
    const label = document.createElement('span');
    label.textContent = `${k.name} · ${(k.bytes / 1e6).toFixed(0)} MB`;
    label.title = k.source;
    const open = Object.assign(document.createElement('button'), { textContent: 'Open', className: 'secondary' });
    open.addEventListener('click', () => loadModel(k.url));
    const del = Object.assign(document.createElement('button'), { textContent: 'Delete', className: 'secondary' });
    del.addEventListener('click', async () => { await forgetModel(k.url); showKept(); });
    li.append(label, open, del);
    return li;
  }));
}

async function loadModel(model) {
  state.ready = false;
  $('send').disabled = $('input').disabled = true;
  if (state.engine) {
    await state.engine.unload().catch(() => {});
    state.engine = null;
  }
  $('progress').hidden = false;
  $('progress-fill').style.width = '0%';
  setStatus('loading', 'loading…');
  const t0 = performance.now();
  try {
    state.engine = await createEngine({
      model, device: params.get('device') ?? 'auto',
      threads: params.has('threads') ? Number(params.get('threads')) : undefined,
      onProgress: (p) => {
        if (p.stage === 'model' && p.total) {
          const pct = (100 * p.loaded) / p.total;
          $('progress-fill').style.width = `${pct.toFixed(1)}%`;
          $('progress-text').textContent = `${p.cached ? 'Reading cached model' : 'Downloading model'}… ${(p.loaded / 1e6).toFixed(0)} / ${(p.total / 1e6).toFixed(0)} MB`;
        } else if (p.message) {
          $('progress-text').textContent = `${p.message}…`;
        }
      },
    });
  } catch (err) {
    setStatus('error', 'failed to load');
    $('progress-text').textContent = `Could not load the model: ${err.message}`;
    state.error = err.message;
    return;
  }
  state.error = null;
  const info = state.engine.info;
  state.loadSeconds = (performance.now() - t0) / 1000;
  $('progress').hidden = true;
  $('i-model').textContent = info.model;
  $('i-device').textContent = info.device === 'webgpu' ? 'WebGPU' : 'WASM (CPU)';
  $('i-threads').textContent = String(info.threads);
  $('i-backend').textContent = info.backend === 'wasm-step' ? "RuvLLM's WASM step" : 'ONNX Runtime Web';
  // the model's own sampling settings (else chat defaults): the temperature starts there, the rest are shown
  const s = info.sampling ?? {};
  if (s.temperature != null) {
    $('temperature').value = String(s.temperature);
    $('temp-out').textContent = Number(s.temperature).toFixed(2);
  }
  $('sampling').textContent = `the model's defaults: ${Object.entries(s).map(([k, v]) => `${k.replace('_', '-')} ${v}`).join(' · ')}`;
  $('i-load').textContent = `${state.loadSeconds.toFixed(1)} s${info.cache?.fromCache ? ' (cached)' : ''}`;
  setBusy(false);
  state.ready = true;
  $('input').focus();
}


$('gguf-file').addEventListener('change', (e) => {
  const files = [...e.target.files]; // a split GGUF's parts, picked together
  if (files.length) loadModel(files.length === 1 ? files[0] : files).then(showKept);
  e.target.value = '';
});
$('gguf-url-form').addEventListener('submit', (e) => {
  e.preventDefault();
  const url = $('gguf-url').value.trim();
  if (url) loadModel(url).then(showKept);
});
$('composer').addEventListener('submit', (e) => {
  e.preventDefault();
  send($('input').value);
});
$('input').addEventListener('keydown', (e) => {
  if (e.key === 'Enter' && !e.shiftKey) {
    e.preventDefault();
    send($('input').value);
  }
});
$('stop').addEventListener('click', () => state.stream?.abort());
$('clear').addEventListener('click', () => {
  state.history = [];
  $('messages').replaceChildren();
  $('welcome').hidden = false;
});
for (const b of document.querySelectorAll('.suggest')) b.addEventListener('click', () => send(b.textContent));
$('temperature').addEventListener('input', () => { $('temp-out').textContent = Number($('temperature').value).toFixed(2); });
$('max-tokens').addEventListener('input', () => { $('max-out').textContent = $('max-tokens').value; });
main();

// A LoRA adapter from the user's own files: served from then on, picked per request in the select
$('adapter-files').addEventListener('change', async (e) => {
  const picked = [...e.target.files];
  if (!picked.length || !state.engine) return;
  const folder = picked[0].webkitRelativePath?.split('/')[0];
  const name = folder || `adapter-${$('adapter').options.length}`;
  $('adapter-status').textContent = `loading ${name}…`;
  try {
    const info = await state.engine.loadAdapter(name, Object.fromEntries(picked.map((f) => [f.name, f])));
    const option = new Option(`${info.name} (rank ${info.rank})`, info.name);
    $('adapter').append(option);
    $('adapter').value = info.name;
    $('adapter-status').textContent = `${info.name}: ${info.targets.join(', ')}`;
  } catch (err) {
    $('adapter-status').textContent = `not loaded: ${err.message}`;
  }
  e.target.value = '';
});
