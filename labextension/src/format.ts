/**
 * Pure formatting: the words and numbers people read. Kept free of DOM and
 * JupyterLab imports so every view says things the same way.
 */
import { IGpuFracEvent, IGpuRef, KernelState } from './api';

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

/** The label and a one-line explanation for every state. */
export const STATE_LABELS: Record<string, { label: string; help: string }> = {
  guaranteed: {
    label: 'guaranteed',
    help: 'Using no more than its guaranteed share.'
  },
  bursting: {
    label: 'bursting',
    help: 'Using loaned memory above its guaranteed share; it may be asked to give it back.'
  },
  shrinking: {
    label: 'shrinking',
    help: 'Asked to give loaned memory back to its owner.'
  },
  'move-pending': {
    label: 'moving soon',
    help: 'The GPU agent asked for a move while a cell runs; the cell may finish until the countdown ends, then it is cut off and the kernel restarts from the state after the last completed cell.'
  },
  migrating: {
    label: 'migrating',
    help: 'Being moved to another GPU now; its variables come back after the restart.'
  },
  restored: {
    label: 'restored',
    help: 'Restarted by jupyter-gpufrac; every variable came back.'
  },
  'restore-incomplete': {
    label: 'restored with losses',
    help: 'Restarted by jupyter-gpufrac, but not everything came back: see what was lost and re-run the cells that make it.'
  },
  'oom-killed': {
    label: 'OOM-killed',
    help: 'Stopped to give GPU memory back; it restarts from the state after its last completed cell.'
  },
  'agent-unreachable': {
    label: 'agent unreachable',
    help: "The GPU agent does not answer, so this kernel's GPU share cannot be verified. Cells still run."
  },
  'no-gpu': { label: 'no GPU', help: 'This kernel holds no GPU lease.' },
  unknown: {
    label: '…',
    help: 'The server has no GPU lease information for this kernel (yet).'
  },
  unavailable: {
    label: 'unavailable',
    help: 'The jupyter-gpufrac server extension did not answer.'
  }
};

export function stateLabel(
  state: KernelState | string,
  deadline?: number | null,
  nowSeconds: number = Date.now() / 1000
): string {
  if (state === 'move-pending' && deadline) {
    return `moving in ${Math.max(0, Math.ceil(deadline - nowSeconds))} s`;
  }
  return STATE_LABELS[state]?.label ?? state;
}

/** Whether a state is on its way somewhere: worth asking the server often. */
export function isTransitional(state: string): boolean {
  return ['move-pending', 'migrating', 'oom-killed', 'shrinking'].includes(
    state
  );
}

/** Whether the view may mark the state as a success: only what the server verified. */
export function isVerifiedSuccess(event: IGpuFracEvent): boolean {
  return event.event === 'restored' && event.ok === true;
}

export function stateHelp(state: KernelState | string): string {
  return STATE_LABELS[state]?.help ?? '';
}

/**
 * A short GPU name for the status bar: vendor words go, and a simulated
 * device's "Simulated" prefix goes too because the item says "simulated" on
 * its own.
 */
export function shortGpuName(gpu: IGpuRef): string {
  let name = gpu.name.replace(/\b(NVIDIA|Tesla|GeForce|Quadro)\s+/gi, '');
  if (gpu.simulated) {
    name = name.replace(/\(?\bsimulated\b\)?/gi, '');
  }
  // "GPU 16GiB" after "GPU 1 ·" would say GPU twice.
  name = name.replace(/^\s*GPU\b\s*/i, '');
  return name.replace(/\s+/g, ' ').trim();
}

/** "GPU 1 · 16GiB · simulated" */
export function gpuLabel(gpu: IGpuRef): string {
  const parts = [`GPU ${gpu.index}`];
  const short = shortGpuName(gpu);
  if (short) {
    parts.push(short);
  }
  if (gpu.simulated) {
    parts.push('simulated');
  }
  return parts.join(' · ');
}

/** "14:02" in the user's locale; the date too when it is not today. */
export function formatTime(unixSeconds: number | undefined): string {
  if (unixSeconds === undefined || !isFinite(unixSeconds)) {
    return '';
  }
  const when = new Date(unixSeconds * 1000);
  const now = new Date();
  const time = when.toLocaleTimeString([], {
    hour: '2-digit',
    minute: '2-digit'
  });
  return when.toDateString() === now.toDateString()
    ? time
    : `${when.toLocaleDateString()} ${time}`;
}

/** "12 of 12 variables restored; lost: gen, fh; cell [7] … was cut off" */
export function restoredSummary(event: IGpuFracEvent): string {
  const restored = event.restored ?? [];
  const lost = event.lost ?? [];
  const total = restored.length + lost.length;
  let text = `${restored.length} of ${total} variable${total === 1 ? '' : 's'} restored`;
  if (lost.length) {
    const names = lost.slice(0, 5).join(', ');
    text += `; lost: ${names}${lost.length > 5 ? ', …' : ''}`;
  }
  if (event.interrupted_cell) {
    text += `; cell ${event.interrupted_cell} was cut off: re-run it`;
  }
  return text;
}

/**
 * One sentence for people. The server writes `message` for exactly this; the
 * fallback only matters for events from an older server.
 */
export function describeEvent(event: IGpuFracEvent): string {
  if (event.message) {
    return event.message;
  }
  const why = event.reason ? ` (${event.reason})` : '';
  switch (event.event) {
    case 'placed':
      return `Placed on GPU ${event.gpu_index ?? '?'}.`;
    case 'bursting':
      return `Bursting above its guaranteed ${formatBytes(event.request)}.`;
    case 'shrink_requested':
      return `Asked to shrink to its guaranteed ${formatBytes(event.request)}${why}.`;
    case 'migrating':
      return `Moving from GPU ${event.from_gpu_index ?? '?'} to GPU ${event.to_gpu_index ?? '?'}${why}.`;
    case 'migrated':
      return `Moved from GPU ${event.from_gpu_index ?? '?'} to GPU ${event.to_gpu_index ?? '?'}${why}.`;
    case 'oom_killed':
      return `Killed to free GPU memory${why}; it restarts from its last checkpoint.`;
    case 'restored':
      return `Restored: ${restoredSummary(event)}.`;
    case 'no_gpu':
      return `Running without a GPU${why}.`;
    case 'move_pending':
      return `Moving to another GPU once the running cell ends, at most at ${formatTime(event.deadline)}${why}.`;
    case 'agent_unreachable':
      return "The GPU agent does not answer; this kernel's GPU share cannot be verified.";
    case 'agent_reachable':
      return 'The GPU agent answers again.';
    default:
      return event.event;
  }
}

/** A stable key so the same event heard twice (stream and poll) counts once. */
export function eventKey(event: IGpuFracEvent): string {
  return `${event.kernel_id}|${event.event}|${event.time ?? ''}`;
}
