/**
 * GPU memory as people read it, in binary units everywhere: "3.2 GiB",
 * "2.1/4.0 GiB". It imports nothing, so every module can say a size.
 */
const GiB = 1024 ** 3;
const MiB = 1024 ** 2;

/** "3.2 GiB", "512 MiB"; GPU memory is counted in binary units everywhere. */
export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined || !isFinite(bytes)) {
    return '–';
  }
  if (Math.abs(bytes) >= GiB) {
    const v = bytes / GiB;
    return `${v >= 100 ? v.toFixed(0) : v.toFixed(1)} GiB`;
  }
  return `${Math.round(bytes / MiB)} MiB`;
}

/** "4.0 GiB–16.0 GiB" from request to limit; "16.0 GiB" when they are one. */
export function shareRange(
  request: number | null | undefined,
  limit: number | null | undefined
): string {
  const from = formatBytes(request);
  const to = formatBytes(limit ?? request);
  return from === to ? from : `${from}–${to}`;
}

/**
 * "2.1/4.0 GiB", "300/512 MiB": usage against request in one unit, the one
 * that suits the larger of the two, so the pair reads at a glance
 * (jupyter-resource-usage's "Mem: 200 MB"). "–" for a figure not sampled,
 * "<0.1" for one too small to show in that unit.
 */
export function usageOfRequest(
  usage: number | null | undefined,
  request: number | null | undefined
): string {
  return sameUnit(usage, request);
}

/** "2.1/4.0/8.0 GiB": usage, request and limit (the full status item). */
export function usageOfShare(
  usage: number | null | undefined,
  request: number | null | undefined,
  limit: number | null | undefined
): string {
  return sameUnit(usage, request, limit);
}

function known(x: number | null | undefined): x is number {
  return x !== null && x !== undefined && isFinite(x);
}

/** The first figure always, the others only where known, in one unit. */
function sameUnit(
  first: number | null | undefined,
  ...rest: Array<number | null | undefined>
): string {
  const scale = Math.max(0, ...[first, ...rest].filter(known).map(Math.abs));
  const inGiB = scale >= GiB;
  const figure = (x: number | null | undefined): string => {
    if (!known(x)) {
      return '–';
    }
    const v = x / (inGiB ? GiB : MiB);
    if (v === 0) {
      return '0'; // nothing at all, not "0.0" beside another's "<0.1"
    }
    const text = !inGiB || v >= 100 ? v.toFixed(0) : v.toFixed(1);
    // A CUDA context alone is 50 MiB: "0.0" would read as nothing used.
    if (v > 0 && Number(text) === 0) {
      return inGiB ? '<0.1' : '<1';
    }
    return text;
  };
  const unit = inGiB ? 'GiB' : 'MiB';
  return `${[first, ...rest.filter(known)].map(figure).join('/')} ${unit}`;
}
