// The WASM step's structs packed by field name, from formats.js (generated from runtime/formats/step_abi.py,
// as wasm/step/abi.h is): no struct offset or size is written by hand here or in its callers.

import { STRUCTS } from './formats.js';

function struct(name) {
  const s = STRUCTS[name];
  if (!s) throw new Error(`the WASM step has no struct ${name}`);
  return s;
}

/** sizeof(name) in wasm32. */
export const sizeOf = (name) => struct(name).size;

/** offsetof(name, field). */
export function offsetOf(name, field) {
  const f = struct(name).fields[field];
  if (!f) throw new Error(`the WASM step's ${name} has no field ${field}`);
  return f.offset;
}

function put(view, at, name, values) {
  const { fields } = struct(name);
  for (const key of Object.keys(values)) if (!(key in fields)) throw new Error(`the WASM step's ${name} has no field ${key}`);
  for (const [key, f] of Object.entries(fields)) {
    if (!(key in values)) throw new Error(`the WASM step's ${name}.${key} is not given`);
    const items = f.count > 1 ? values[key] : [values[key]];
    if (items.length !== f.count) throw new Error(`the WASM step's ${name}.${key} takes ${f.count} values, not ${items.length}`);
    const nested = STRUCTS[f.kind], stride = nested ? nested.size : 4;
    items.forEach((v, i) => {
      const o = at + f.offset + i * stride;
      if (nested) put(view, o, f.kind, v);
      else if (f.kind === 'f32') view.setFloat32(o, v, true);
      else if (f.kind === 'ptr') view.setUint32(o, v >>> 0, true);
      else view.setInt32(o, v, true);
    });
  }
}

/** Struct `name` written at byte `at` of `buffer` (the module's memory's buffer): every field given (0 for a
 * null pointer), a C array as an array, a nested struct as an object. */
export function writeStruct(buffer, at, name, values) {
  put(new DataView(buffer), at, name, values);
}

/** A C array of struct `name` from `items`, from byte `at`. */
export function writeStructs(buffer, at, name, items) {
  const view = new DataView(buffer), size = sizeOf(name);
  items.forEach((values, i) => put(view, at + i * size, name, values));
}
