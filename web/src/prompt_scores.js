// A prompt's own log-probabilities (prompt_logprobs, the completions API's echo): each scored row's
// log-softmax at the prompt's next token, from the row's raw logits, in float64 as the native backend
// computes it (runtime/backends/native.py row_logprobs). -1: a row that scores nothing (0).

export function rowLogprobs(rowAt, scoreIds) {
  return scoreIds.map((token, r) => {
    if (token < 0) return 0;
    const row = rowAt(r);
    let top = -Infinity;
    for (let i = 0; i < row.length; i++) if (row[i] > top) top = row[i];
    let sum = 0;
    for (let i = 0; i < row.length; i++) sum += Math.exp(row[i] - top);
    return row[token] - top - Math.log(sum);
  });
}
