/**
 * Pure decisions about what people see: which state to show, in which words
 * and colour, whether it may look like a success, and the notification texts.
 * No DOM, no JupyterLab: `npm test` runs it under Node.
 */
import { formatBytes, gpuLabel, usageOfRequest } from './format';
import { IGpuFracEvent, IKernelStatus, ILease, IRestore } from './api';

/** JupyterLab cuts notification messages longer than this (mid-word). */
export const MAX_NOTICE = 140;

/** How worried to be; drives the badge colour together with data-state. */
export type Severity = 'plain' | 'success' | 'info' | 'warning' | 'error';

/** What the agent's reachability signals say, newest first (see model.ts). */
export interface IAgentHealth {
  down: boolean;
  /** The reason text people read while it is down. */
  reason: string | null;
}

/** Everything the status item and the panel need to show the state. */
export interface IStateView {
  /** The state shown (data-state): the server's, unless the agent is down. */
  state: string;
  /** The badge words: "guaranteed", "moving in 23 s — cell still running". */
  label: string;
  /** One sentence explaining the state. */
  help: string;
  /** The server's (or the agent health's) reason, or ''. */
  reason: string;
  severity: Severity;
  /** Whether the view may mark this as a success (green, tick). */
  success: boolean;
  /** Whether the usage figures are verified by the agent ("guaranteed"). */
  verified: boolean;
  /** Seconds left before a pending move cuts the running cell off. */
  secondsLeft: number | null;
}

const HELP: Record<string, string> = {
  guaranteed: 'Using no more than its guaranteed share.',
  bursting:
    'Using loaned memory above its guaranteed share; it may be asked to give it back.',
  shrinking: 'Asked to give loaned memory back to its owner.',
  'move-pending':
    'The GPU agent asked for a move while a cell runs: the cell may finish until the countdown ends, otherwise it is cut off and the kernel restarts from the state after the last completed cell.',
  migrating:
    'Being moved to another GPU now: checkpoint, restart, restore. Its variables come back after the restart.',
  restored: 'Restarted by jupyter-gpufrac; every variable came back.',
  'restore-incomplete':
    'Restarted by jupyter-gpufrac, but not everything came back: see what was lost and re-run the cells that make it.',
  'oom-killed':
    'Stopped by the GPU agent, to give memory back or because a move did not finish in time (the reason says which); it restarts from the state after its last completed cell.',
  'agent-unreachable':
    "The GPU agent does not answer, so this kernel's GPU share cannot be verified. Cells still run.",
  'no-gpu': 'This kernel holds no GPU lease.',
  unknown: 'The server has no GPU lease information for this kernel (yet).',
  unavailable: 'The jupyter-gpufrac server extension did not answer.'
};

const LABEL: Record<string, string> = {
  'move-pending': 'moving soon — cell still running',
  'restore-incomplete': 'restored with losses',
  // Not "OOM-killed": the agent also stops a kernel whose move ran out of time.
  'oom-killed': 'stopped',
  'agent-unreachable': 'agent unreachable',
  'no-gpu': 'no GPU',
  unknown: '…'
};

const SEVERITY: Record<string, Severity> = {
  guaranteed: 'plain',
  bursting: 'warning',
  shrinking: 'warning',
  'move-pending': 'warning',
  migrating: 'info',
  restored: 'success',
  'restore-incomplete': 'warning',
  'oom-killed': 'error',
  'agent-unreachable': 'error',
  unavailable: 'error',
  'no-gpu': 'plain',
  unknown: 'plain'
};

/**
 * The state to show. Without the agent nothing about the share is verified,
 * so every lease state reads "agent unreachable"; only "no GPU" (no share to
 * verify) and "unavailable" (the server itself did not answer) stay.
 */
export function effectiveState(
  state: string,
  agent: IAgentHealth | null
): string {
  if (agent?.down && state !== 'no-gpu' && state !== 'unavailable') {
    return 'agent-unreachable';
  }
  return state;
}

/** "moving in 23 s — cell still running"; "moving now" once the time is up. */
export function countdownLabel(deadline: number, nowSeconds: number): string {
  const left = Math.ceil(deadline - nowSeconds);
  return left > 0
    ? `moving in ${left} s — cell still running`
    : 'moving now — cell still running';
}

export function stateLabel(
  state: string,
  deadline?: number | null,
  nowSeconds: number = Date.now() / 1000
): string {
  if (state === 'move-pending' && deadline) {
    return countdownLabel(deadline, nowSeconds);
  }
  return LABEL[state] ?? state;
}

export function stateHelp(state: string): string {
  return HELP[state] ?? '';
}

/** Whether a state is on its way somewhere: worth asking the server every second. */
export function isTransitional(state: string): boolean {
  return ['move-pending', 'migrating', 'oom-killed'].includes(state);
}

/**
 * From what the model knows to what the views show.
 *
 * @param state - the server's state, or the model's local one
 *   ('unknown' / 'unavailable') when there is no status
 */
export function stateView(
  state: string,
  status: IKernelStatus | null,
  agent: IAgentHealth | null,
  nowSeconds: number = Date.now() / 1000
): IStateView {
  const shown = effectiveState(state, agent);
  const overridden = shown !== state;
  const deadline = shown === 'move-pending' ? (status?.deadline ?? null) : null;
  let reason = overridden ? (agent?.reason ?? '') : (status?.reason ?? '');
  if (shown === 'agent-unreachable' && !reason) {
    reason = agent?.reason ?? '';
  }
  return {
    state: shown,
    label: stateLabel(shown, deadline, nowSeconds),
    help: stateHelp(shown),
    reason: reason.trim(),
    severity: SEVERITY[shown] ?? 'plain',
    // "restored" is the server's word for a restore the kernel verified.
    success: shown === 'restored',
    verified: [
      'guaranteed',
      'bursting',
      'restored',
      'restore-incomplete'
    ].includes(shown),
    secondsLeft:
      deadline !== null ? Math.max(0, Math.ceil(deadline - nowSeconds)) : null
  };
}

// -- the status bar item -----------------------------------------------------

/**
 * The status bar item's line, "GPU 1: 2.1/4.0 GiB · bursting": it shares the
 * bar with JupyterLab's own items (and jupyter-resource-usage's "Mem: 200 MB"),
 * so it says the numbers and, only when there is news, one short word; the
 * device, the limit and the whole story go to the tooltip and the panel.
 */
export interface IStatusLabel {
  /** "GPU 1"; "GPU" while no GPU is known; '' without a lease ("no GPU" says it). */
  gpu: string;
  /** Usage against request ("2.1/4.0 GiB"), "?" while the agent cannot verify them, '' when not shown. */
  figures: string;
  /** A short state word; '' while the lease is plainly guaranteed. */
  word: string;
  /** The whole line as read. */
  text: string;
}

/** The status bar's words; the panel and the tooltip keep the long ones. */
const SHORT: Record<string, string> = {
  guaranteed: '',
  bursting: 'bursting',
  shrinking: 'shrinking',
  migrating: 'moving',
  'oom-killed': 'stopped',
  restored: 'restored',
  'restore-incomplete': 'losses',
  'agent-unreachable': 'agent unreachable',
  'no-gpu': 'no GPU',
  unavailable: 'unavailable',
  unknown: ''
};

/** "moving in 23 s" (the countdown is the news), "bursting", or ''. */
export function shortStateWord(view: IStateView): string {
  if (view.state === 'move-pending') {
    if (view.secondsLeft === null) {
      return 'moving soon';
    }
    return view.secondsLeft > 0
      ? `moving in ${view.secondsLeft} s`
      : 'moving now';
  }
  return SHORT[view.state] ?? view.label;
}

/**
 * Figures only while the agent vouches for them (`verified`); "?" while it
 * does not answer, so a last known figure never passes for a current one; none
 * while a shrink, move or kill is changing them (the tooltip has the last
 * known ones).
 */
export function statusLabel(
  status: IKernelStatus | null,
  view: IStateView
): IStatusLabel {
  const device = status?.gpu ?? null;
  const gpu = device
    ? `GPU ${device.index}`
    : view.state === 'no-gpu'
      ? ''
      : 'GPU';
  let figures = '';
  if (view.state === 'unknown') {
    figures = '…';
  } else if (device && view.verified) {
    figures = usageOfRequest(status?.usage, status?.request);
  } else if (device && view.state === 'agent-unreachable') {
    figures = '?';
  }
  const word = shortStateWord(view);
  const head = figures ? `${gpu}: ${figures}` : gpu;
  return {
    gpu,
    figures,
    word,
    text: [head, word].filter(Boolean).join(' · ')
  };
}

/** The tooltip and the screen reader's words for the status bar item. */
export interface IStatusDescription {
  title: string;
  ariaLabel: string;
}

/**
 * Everything the item leaves out: the device, usage, request and limit (as
 * last known while unverified), the state in full and why.
 */
export function statusDescription(
  status: IKernelStatus | null,
  view: IStateView
): IStatusDescription {
  const gpu = status?.gpu ?? null;
  const device = gpu ? gpuLabel(gpu) : '';
  const memory = !gpu
    ? ''
    : view.verified
      ? `${formatBytes(status?.usage)} used of ${formatBytes(status?.request)} guaranteed, ${formatBytes(status?.limit)} limit`
      : `last known: ${formatBytes(status?.usage)} used, ${formatBytes(status?.request)} requested, ${formatBytes(status?.limit)} limit (not verified)`;
  const reason = view.reason ? ` ${view.reason}` : '';
  const lines = [
    device,
    memory && `${memory.charAt(0).toUpperCase()}${memory.slice(1)}.`,
    `${view.label.charAt(0).toUpperCase()}${view.label.slice(1)}: ${view.help}${reason}`,
    'Click for details.'
  ];
  const summary = [device, memory, view.label].filter(Boolean).join(', ');
  return {
    title: lines.filter(Boolean).join('\n'),
    ariaLabel: `GPU lease: ${summary}.${reason} Press Enter for details.`
  };
}

// -- words -------------------------------------------------------------------

/**
 * Shorten to at most `max` characters at a word boundary, with "…". A single
 * word longer than that is the only thing ever cut inside.
 */
export function fitWords(text: string, max: number): string {
  const clean = text.replace(/\s+/g, ' ').trim();
  if (clean.length <= max) {
    return clean;
  }
  const room = clean.slice(0, Math.max(0, max - 1));
  const space = room.lastIndexOf(' ');
  const cut = space > max / 3 ? room.slice(0, space) : room;
  return `${cut.replace(/[\s,;:—–-]+$/, '')}…`;
}

/** "train.ipynb" from "work/train.ipynb"; long names keep their start. */
export function notebookName(path: string | null | undefined): string {
  if (!path) {
    return '';
  }
  const name = path.split('/').pop() ?? path;
  return name.length > 40 ? `${name.slice(0, 39)}…` : name;
}

/** "a, b and c"; past `max` names: "a, b and 3 more". */
export function nameList(names: string[], max = Infinity): string {
  const shown = names.slice(0, Math.max(1, max));
  const more = names.length - shown.length;
  if (more > 0) {
    return `${shown.join(', ')} and ${more} more`;
  }
  if (shown.length <= 1) {
    return shown.join('');
  }
  return `${shown.slice(0, -1).join(', ')} and ${shown[shown.length - 1]}`;
}

/** "[7] for epoch in…": the cell's number stays, its first line is shortened. */
export function cellLabel(cell: string, max = Infinity): string {
  return max === Infinity ? cell.trim() : fitWords(cell, max);
}

/** What a restore brought back, from the kernel status or the `restored` event. */
export interface IRestoreFacts {
  ok?: boolean;
  restored?: string[];
  lost?: string[];
  lost_reasons?: Record<string, string>;
  /** Kept on disk for lack of room on the GPU: name to bytes. */
  deferred?: Record<string, number>;
  interrupted_cell?: string | null;
  error?: string | null;
}

export function restoreFactsOf(
  source: IRestore | IGpuFracEvent
): IRestoreFacts {
  return {
    ok: source.ok,
    restored: source.restored ?? [],
    lost: source.lost ?? [],
    lost_reasons: 'lost_reasons' in source ? source.lost_reasons : undefined,
    deferred: source.deferred ?? {},
    interrupted_cell: source.interrupted_cell ?? null,
    error: 'error' in source ? source.error : null
  };
}

/** Whether nothing was said about what came back (no report, or an error). */
function unreported(facts: IRestoreFacts): boolean {
  return (
    !!facts.error ||
    (facts.ok !== true &&
      !(facts.restored ?? []).length &&
      !(facts.lost ?? []).length &&
      !deferredNames(facts).length &&
      !facts.interrupted_cell)
  );
}

function deferredNames(facts: IRestoreFacts): string[] {
  return Object.keys(facts.deferred ?? {}).sort();
}

/** "big (900.0 MiB), x (1.0 GiB)": what waits on disk, with sizes. */
function deferredList(facts: IRestoreFacts, max = Infinity): string {
  const names = deferredNames(facts);
  const shown = names
    .slice(0, Math.max(1, max))
    .map(name => `${name} (${formatBytes(facts.deferred?.[name])})`);
  const more = names.length - shown.length;
  return `${shown.join(', ')}${more > 0 ? ` and ${more} more` : ''}`;
}

export interface ISummaryOptions {
  /** Most lost names to list (default all). */
  maxNames?: number;
  /** Most characters of the cut-off cell (default all). */
  cellChars?: number;
  /** Each lost name with why it was lost (lost_reasons), where there is room. */
  reasons?: boolean;
  /** Say what to do: re-run the cell and the cells that create the lost names. */
  advice?: boolean;
}

/**
 * In the server's words: "2 of 3 variables restored; lost: gen — re-run the
 * cells that create it; cell [7] train() was cut off: re-run it".
 */
export function restoreSummary(
  facts: IRestoreFacts,
  options: ISummaryOptions = {}
): string {
  const { maxNames = Infinity, cellChars = Infinity, advice = true } = options;
  const restored = facts.restored ?? [];
  const lost = facts.lost ?? [];
  const parts: string[] = [];
  if (facts.error) {
    parts.push(`no variables were restored: ${facts.error}`);
  } else if (unreported(facts)) {
    parts.push('the kernel did not report what came back');
  } else {
    const total = restored.length + lost.length + deferredNames(facts).length;
    parts.push(
      `${restored.length} of ${total} variable${total === 1 ? '' : 's'} restored`
    );
  }
  if (deferredNames(facts).length) {
    parts.push(
      `kept on disk until there is room on the GPU: ${deferredList(facts, maxNames)}${advice ? ' — %gpu restore loads them' : ''}`
    );
  }
  if (lost.length) {
    const shown = lost.slice(0, Math.max(1, maxNames)).map(name => {
      const why = options.reasons ? facts.lost_reasons?.[name] : undefined;
      return why ? `${name} (${why})` : name;
    });
    const more = lost.length - shown.length;
    let text = `lost: ${shown.join(', ')}${more > 0 ? ` and ${more} more` : ''}`;
    if (advice) {
      text += ` — re-run the cells that create ${lost.length === 1 ? 'it' : 'them'}`;
    }
    parts.push(text);
  }
  if (facts.interrupted_cell) {
    parts.push(
      `cell ${cellLabel(facts.interrupted_cell, cellChars)} was cut off${advice ? ': re-run it' : ''}`
    );
  }
  if (advice && unreported(facts)) {
    parts.push('run %gpu in the notebook to see what it holds');
  }
  return parts.join('; ');
}

/** What to do after a restore, or '' when nothing is to be done. */
export function restoreAdvice(facts: IRestoreFacts): string {
  const todo: string[] = [];
  if (facts.interrupted_cell) {
    todo.push(`re-run cell ${cellLabel(facts.interrupted_cell)}`);
  }
  const lost = facts.lost ?? [];
  if (lost.length) {
    todo.push(
      `re-run the cell${lost.length === 1 ? '' : 's'} that create${lost.length === 1 ? 's' : ''} ${nameList(lost)}`
    );
  }
  if (deferredNames(facts).length) {
    todo.push(
      `run %gpu restore once there is room on the GPU to load ${nameList(deferredNames(facts))}`
    );
  }
  if (unreported(facts)) {
    todo.push('run %gpu in the notebook to see what it holds');
  }
  if (!todo.length) {
    return '';
  }
  const text = todo.join(', then ');
  return `${text.charAt(0).toUpperCase()}${text.slice(1)}.`;
}

/** Whether a `restored` event may be shown as a success: only what the kernel verified. */
export function isVerifiedSuccess(event: IGpuFracEvent): boolean {
  return event.event === 'restored' && event.ok === true;
}

export interface INotice {
  message: string;
  type: 'success' | 'warning';
}

function sentence(text: string): string {
  const t = text.trim();
  if (!t) {
    return '';
  }
  const capital = `${t.charAt(0).toUpperCase()}${t.slice(1)}`;
  return /[.!?…]$/.test(capital) ? capital : `${capital}.`;
}

function withPrefix(prefix: string, text: string): string {
  return prefix ? `${prefix}: ${text}` : text;
}

/**
 * The notification after a restart with restore. A success only when the
 * kernel said everything came back (`ok`); otherwise a warning that names the
 * notebook, what was lost, the cell cut off and what to do. It fits in
 * MAX_NOTICE characters by listing fewer names and less of the cell first,
 * then dropping the cause, and only then cutting at a word ("…"); the
 * "Details" action opens the panel, which has the whole story.
 */
export function restoredNotice(
  event: IGpuFracEvent,
  notebook: string | null,
  max: number = MAX_NOTICE
): INotice {
  const prefix = notebookName(notebook);
  const facts = restoreFactsOf(event);
  const cause = sentence(event.reason ?? '');
  if (isVerifiedSuccess(event)) {
    const facts0 = sentence(restoreSummary(facts, { advice: false }));
    const full = withPrefix(prefix, cause ? `${facts0} ${cause}` : facts0);
    return {
      type: 'success',
      message:
        full.length <= max ? full : fitWords(withPrefix(prefix, facts0), max)
    };
  }
  const lost = facts.lost ?? [];
  const cell = facts.interrupted_cell ?? null;
  if (unreported(facts)) {
    // No report: the server's words, then what to do.
    const body = `Restored with losses — ${restoreSummary(facts)}`;
    return {
      type: 'warning',
      message: fitWords(withPrefix(prefix, sentence(body)), max)
    };
  }
  if (!lost.length && !cell && deferredNames(facts).length) {
    // Nothing lost: some variables wait on disk until the GPU has room for them.
    const body = `Restored; kept on disk for lack of GPU room: ${deferredList(facts, 2)}. Run %gpu restore once there is room`;
    return {
      type: 'warning',
      message: fitWords(withPrefix(prefix, sentence(body)), max)
    };
  }
  if (!lost.length && !cell) {
    // ok missing (an older server): the names came back, but nobody said so.
    const body = `Restored, not verified: ${restoreSummary(facts, { advice: false })}; run %gpu in the notebook to check`;
    return {
      type: 'warning',
      message: fitWords(withPrefix(prefix, sentence(body)), max)
    };
  }
  const advice =
    lost.length && cell
      ? 'Re-run it and the cells that create the lost names.'
      : cell
        ? 'Re-run it.'
        : `Re-run the cells that create ${lost.length === 1 ? 'it' : 'them'}.`;
  const compose = (
    count: boolean,
    maxNames: number,
    cellChars: number,
    withCause: boolean
  ): string => {
    const parts: string[] = [];
    if (count) {
      const total = (facts.restored ?? []).length + lost.length;
      parts.push(
        `${(facts.restored ?? []).length} of ${total} variables restored`
      );
    }
    if (lost.length) {
      // Names when there is room; only their number as a last resort.
      parts.push(
        maxNames > 0
          ? `lost: ${nameList(lost, maxNames)}`
          : `lost: ${lost.length} variable${lost.length === 1 ? '' : 's'}`
      );
    }
    if (cell) {
      parts.push(`cell ${cellLabel(cell, cellChars)} was cut off`);
    }
    const body = `Restored with losses — ${parts.join('; ')}. ${advice}`;
    return withPrefix(prefix, withCause && cause ? `${body} ${cause}` : body);
  };
  const tiers: Array<[boolean, number, number, boolean]> = [
    [true, Infinity, Infinity, true],
    [true, Infinity, Infinity, false],
    [false, Infinity, Infinity, false],
    [false, 4, 48, false],
    [false, 2, 32, false],
    [false, 1, 20, false],
    [false, 0, 12, false]
  ];
  for (const [count, maxNames, cellChars, withCause] of tiers) {
    const text = compose(count, maxNames, cellChars, withCause);
    if (text.length <= max) {
      return { type: 'warning', message: text };
    }
  }
  return {
    type: 'warning',
    message: fitWords(compose(false, 0, 8, false), max)
  };
}

/** Any other notification: the notebook, then the server's sentence, cut at a word. */
export function eventNotice(
  text: string,
  notebook: string | null,
  max: number = MAX_NOTICE
): string {
  return fitWords(withPrefix(notebookName(notebook), text), max);
}

/**
 * The lease's SM utilization against its compute share, and whether the share
 * holds (only CUDA MPS holds one); null when the lease has neither.
 */
export function computeLine(lease: ILease, mps: boolean): string | null {
  const used = lease.compute_usage;
  const request = lease.compute_request;
  const usedText =
    used === null || used === undefined
      ? 'not sampled'
      : `${used}% of the GPU's SMs`;
  if (request === null || request === undefined) {
    return used === null || used === undefined ? null : usedText;
  }
  const limit = lease.compute_limit;
  const share =
    limit === null || limit === undefined || limit === request
      ? `${request}`
      : `${request}–${limit}`;
  const held = mps ? 'held by CUDA MPS' : 'not enforced: no CUDA MPS';
  return `${usedText}; share ${share} of the compute (${held})`;
}
