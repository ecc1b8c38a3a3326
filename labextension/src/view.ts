/**
 * Pure decisions about what people see: which state to show, in which words
 * and colour, whether it may look like a success, and the notification texts.
 * No DOM, no JupyterLab: `npm test` runs it under Node.
 */
import {
  formatAge,
  formatBytes,
  gpuLabel,
  shortGpuName,
  usageOfRequest,
  usageOfShare
} from './format';
import {
  CHECKPOINT_ON_DISK,
  FROZEN_IN_HOST_MEMORY,
  IGpuFracEvent,
  IKernelStatus,
  ILease,
  IRecoveryPoint,
  IRestore,
  IShareSource
} from './api';
import { LEASE_STATE_WORDS } from './contract';
import { defaultTrans, ITrans } from './trans';

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

/**
 * The driver's part while a kernel has no GPU (DESIGN.md "freeze / thaw"):
 * its process frozen, every variable kept in host memory; or on the way
 * there or back.
 */
export type Hold = 'frozen' | 'freezing' | 'thawing';

/** Everything the status item and the panel need to show the state. */
export interface IStateView {
  /** The state shown (data-state): the server's, unless the agent is down. */
  state: string;
  /** Parked or waiting for a GPU: whether it is frozen (or freezing, thawing). */
  hold: Hold | null;
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
  /** After an incomplete restore, what did not come back, most important first: ["2 variables lost", "1 cell cut off"]. */
  shortfall: string[];
}

// Built per call, not once: the words are in the user's language, and
// `trans.__('…')` with a literal is what the string extractor finds.
function helps(trans: ITrans): Record<string, string> {
  return {
    guaranteed: trans.__('Using no more than its guaranteed share.'),
    bursting: trans.__(
      'Using loaned memory above its guaranteed share; it may be asked to give it back.'
    ),
    shrinking: trans.__('Asked to give loaned memory back to its owner.'),
    'move-pending': trans.__(
      'The GPU agent asked for a move while a cell runs: the cell may finish until the countdown ends, otherwise it is cut off and the kernel restarts from the state after the last completed cell.'
    ),
    migrating: trans.__(
      'Being moved to another GPU now: checkpoint, restart, restore. Its variables come back after the restart.'
    ),
    restored: trans.__(
      'Restarted by jupyter-gpufrac; every variable came back.'
    ),
    'restore-incomplete': trans.__(
      'Restarted by jupyter-gpufrac, but not everything came back: see what was lost and re-run the cells that make it.'
    ),
    'oom-killed': trans.__(
      'Stopped by the GPU agent, to give memory back or because a move did not finish in time (the reason says which); it restarts from the state after its last completed cell.'
    ),
    'agent-unreachable': trans.__(
      "The GPU agent does not answer, so this kernel's GPU share cannot be verified. Cells still run."
    ),
    'no-gpu': trans.__('This kernel holds no GPU lease.'),
    parked: trans.__(
      'Idle, so its GPU was given back; its variables are kept in host memory. The next cell gets a GPU first (maybe another one), then runs.'
    ),
    'waiting-for-gpu': trans.__(
      'A cell is waiting for a GPU with room for this kernel; it runs as soon as there is one. Interrupt the kernel to cancel.'
    ),
    unknown: trans.__(
      'The server has no GPU lease information for this kernel (yet).'
    ),
    unavailable: trans.__(
      'The jupyter-gpufrac server extension did not answer.'
    )
  };
}

// Keyed "<state>:<hold>"; a hold with no words of its own for a state reads
// as the hold alone ("freezing", "thawing").
function holdHelps(trans: ITrans): Record<string, string> {
  return {
    'parked:frozen': trans.__(
      'Idle, so it was frozen: the driver moved its GPU memory into host memory and gave the GPU back; the process runs on with every variable, open file and thread. Its next cell thaws it first (on this GPU or another of the same model), then runs.'
    ),
    'waiting-for-gpu:frozen': trans.__(
      'Frozen while its GPU is needed elsewhere: its process and every variable wait in host memory (a running cell waits too), and it thaws by itself once a GPU has room. Nothing is restarted.'
    ),
    freezing: trans.__(
      'Being frozen: the driver moves its GPU memory into host memory, then gives the GPU back. Nothing is restarted; every variable is kept.'
    ),
    thawing: trans.__(
      'Being thawed: the driver puts its GPU memory back, then the waiting cell runs. Nothing was restarted; every variable is kept.'
    )
  };
}

function holdLabels(trans: ITrans): Record<string, string> {
  return {
    'parked:frozen': trans.__('parked · frozen'),
    'waiting-for-gpu:frozen': trans.__('waiting for a GPU · frozen'),
    freezing: trans.__('freezing'),
    thawing: trans.__('thawing')
  };
}

/** The status bar's words for a hold: within its 32 characters. */
function holdShortWords(trans: ITrans): Record<string, string> {
  return {
    'parked:frozen': trans.__('parked · frozen'),
    'waiting-for-gpu:frozen': trans.__('waiting · frozen'),
    freezing: trans.__('freezing'),
    thawing: trans.__('thawing')
  };
}

/** The words of `table` for a state with a hold, if it has any. */
function holdWords(
  table: Record<string, string>,
  state: string,
  hold: Hold | null
): string | undefined {
  return hold ? (table[`${state}:${hold}`] ?? table[hold]) : undefined;
}

function labels(trans: ITrans): Record<string, string> {
  return {
    guaranteed: trans.__('guaranteed'),
    bursting: trans.__('bursting'),
    shrinking: trans.__('shrinking'),
    'move-pending': trans.__('moving soon — cell still running'),
    migrating: trans.__('migrating'),
    restored: trans.__('restored'),
    'restore-incomplete': trans.__('restored in part'),
    // Not "OOM-killed": the agent also stops a kernel whose move ran out of time.
    'oom-killed': trans.__('stopped'),
    'agent-unreachable': trans.__('agent unreachable'),
    'no-gpu': trans.__('no GPU'),
    parked: trans.__('parked'),
    'waiting-for-gpu': trans.__('waiting for a GPU'),
    unavailable: trans.__('unavailable'),
    unknown: '…'
  };
}

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
  parked: 'info',
  'waiting-for-gpu': 'warning',
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
export function countdownLabel(
  deadline: number,
  nowSeconds: number,
  trans: ITrans = defaultTrans
): string {
  const left = Math.ceil(deadline - nowSeconds);
  return left > 0
    ? trans.__('moving in %1 s — cell still running', left)
    : trans.__('moving now — cell still running');
}

export function stateLabel(
  state: string,
  deadline?: number | null,
  nowSeconds: number = Date.now() / 1000,
  trans: ITrans = defaultTrans
): string {
  if (state === 'move-pending' && deadline) {
    return countdownLabel(deadline, nowSeconds, trans);
  }
  return labels(trans)[state] ?? state;
}

export function stateHelp(state: string, trans: ITrans = defaultTrans): string {
  return helps(trans)[state] ?? '';
}

/** Whether a state is on its way somewhere: worth asking the server every second. */
export function isTransitional(state: string): boolean {
  return ['move-pending', 'migrating', 'oom-killed'].includes(state);
}

/** As isTransitional, and also while the driver freezes or thaws the kernel. */
export function isChanging(view: Pick<IStateView, 'state' | 'hold'>): boolean {
  return (
    isTransitional(view.state) ||
    view.hold === 'freezing' ||
    view.hold === 'thawing'
  );
}

/**
 * Whether a kernel without a GPU (parked, or waiting for one) is frozen, or
 * being frozen or thawed: from its lease, or from the protection an event
 * just named (the model's guess until the next fetch). Null in any other
 * state: a kernel on its GPU holds nothing in host memory.
 */
export function holdOf(
  state: string,
  status: IKernelStatus | null
): Hold | null {
  if (state !== 'parked' && state !== 'waiting-for-gpu') {
    return null;
  }
  const leaseState = status?.lease?.state;
  if (leaseState === 'freezing' || leaseState === 'thawing') {
    return leaseState;
  }
  if (
    status?.lease?.frozen === true ||
    status?.protection === FROZEN_IN_HOST_MEMORY
  ) {
    return 'frozen';
  }
  return null;
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
  nowSeconds: number = Date.now() / 1000,
  trans: ITrans = defaultTrans
): IStateView {
  const shown = effectiveState(state, agent);
  const overridden = shown !== state;
  const deadline = shown === 'move-pending' ? (status?.deadline ?? null) : null;
  let reason = overridden ? (agent?.reason ?? '') : (status?.reason ?? '');
  if (shown === 'agent-unreachable' && !reason) {
    reason = agent?.reason ?? '';
  }
  const hold = holdOf(shown, status);
  const shortfall =
    shown === 'restore-incomplete' && status?.restore
      ? restoreShortfall(restoreFactsOf(status.restore), trans)
      : [];
  return {
    state: shown,
    hold,
    label: shortfall.length
      ? trans.__('restored · %1', shortfall.join(', '))
      : (holdWords(holdLabels(trans), shown, hold) ??
        stateLabel(shown, deadline, nowSeconds, trans)),
    shortfall,
    help: holdWords(holdHelps(trans), shown, hold) ?? stateHelp(shown, trans),
    reason: reason.trim(),
    // Thawing is the way back: news, not worry.
    severity: hold === 'thawing' ? 'info' : (SEVERITY[shown] ?? 'plain'),
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
 * `compact`: the numbers and a word only when there is news, because the item
 * shares the bar; `full`: for those who want the device, the limit and the
 * state at a glance and have the room.
 */
export type StatusItemMode = 'compact' | 'full';

/** The extension's settings (schema/plugin.json), as the views use them. */
export interface IGpuFracSettings {
  /** The settled poll interval, ms. */
  refreshInterval: number;
  statusItem: StatusItemMode;
}

export const DEFAULT_SETTINGS: Readonly<IGpuFracSettings> = {
  refreshInterval: 5000,
  statusItem: 'compact'
};

/** The schema's minimum: the transition pace (1 s) is the floor anyway. */
export const MIN_REFRESH_MS = 1000;

/**
 * Settings from the registry's composite. The registry validates against the
 * schema, but a hand-edited overrides.json or an older schema can still hand
 * over anything: out-of-range values fall back, nothing throws.
 */
export function readSettings(
  raw: Record<string, unknown> | null | undefined
): IGpuFracSettings {
  const interval = raw?.refreshInterval;
  return {
    refreshInterval:
      typeof interval === 'number' && isFinite(interval)
        ? Math.max(MIN_REFRESH_MS, Math.round(interval))
        : DEFAULT_SETTINGS.refreshInterval,
    statusItem: raw?.statusItem === 'full' ? 'full' : 'compact'
  };
}

/**
 * The status bar item's line, "GPU 1: 2.1/4.0 GiB · bursting": it shares the
 * bar with JupyterLab's own items (and jupyter-resource-usage's "Mem: 200 MB"),
 * so it says the numbers and, only when there is news, one short word; the
 * device, the limit and the whole story go to the tooltip and the panel.
 */
export interface IStatusLabel {
  /** "GPU 1" ("GPU 1 (T4)" in full); "GPU" while no GPU is known; '' without a lease ("no GPU" says it). */
  gpu: string;
  /** Usage against request ("2.1/4.0 GiB", "2.1/4.0/8.0 GiB" in full), "?" while the agent cannot verify them, '' when not shown. */
  figures: string;
  /** A short state word; '' while the lease is plainly guaranteed (compact). */
  word: string;
  /** The whole line as read. */
  text: string;
}

/** The status bar's words; the panel and the tooltip keep the long ones. */
function shortWords(trans: ITrans): Record<string, string> {
  return {
    guaranteed: '',
    bursting: trans.__('bursting'),
    shrinking: trans.__('shrinking'),
    migrating: trans.__('moving'),
    'oom-killed': trans.__('stopped'),
    restored: trans.__('restored'),
    'restore-incomplete': trans.__('restored in part'),
    'agent-unreachable': trans.__('agent unreachable'),
    'no-gpu': trans.__('no GPU'),
    parked: trans.__('parked'),
    'waiting-for-gpu': trans.__('waiting for a GPU'),
    unavailable: trans.__('unavailable'),
    unknown: ''
  };
}

/** "moving in 23 s" (the countdown is the news), "bursting", or ''. */
export function shortStateWord(
  view: IStateView,
  trans: ITrans = defaultTrans
): string {
  if (view.state === 'move-pending') {
    if (view.secondsLeft === null) {
      return trans.__('moving soon');
    }
    return view.secondsLeft > 0
      ? trans.__('moving in %1 s', view.secondsLeft)
      : trans.__('moving now');
  }
  if (view.shortfall.length) {
    // The most important alone: the tooltip and the panel have the rest.
    return view.shortfall[0];
  }
  return (
    holdWords(holdShortWords(trans), view.state, view.hold) ??
    shortWords(trans)[view.state] ??
    view.label
  );
}

/**
 * Figures only while the agent vouches for them (`verified`); "?" while it
 * does not answer, so a last known figure never passes for a current one; none
 * while a shrink, move or kill is changing them (the tooltip has the last
 * known ones). `full` adds the GPU's name, the limit and always a state word.
 */
export function statusLabel(
  status: IKernelStatus | null,
  view: IStateView,
  mode: StatusItemMode = 'compact',
  trans: ITrans = defaultTrans
): IStatusLabel {
  const full = mode === 'full';
  const device = status?.gpu ?? null;
  let gpu = '';
  if (device) {
    const name = full ? shortGpuName(device) : '';
    gpu = name
      ? trans.__('GPU %1 (%2)', device.index, name)
      : trans.__('GPU %1', device.index);
  } else if (view.state !== 'no-gpu' && view.state !== 'parked') {
    gpu = trans.__('GPU');
  }
  let figures = '';
  if (view.state === 'unknown') {
    figures = '…';
  } else if (device && view.verified && view.state !== 'restore-incomplete') {
    // After an incomplete restore what is missing is the news: the word alone.
    figures = full
      ? usageOfShare(status?.usage, status?.request, status?.limit)
      : usageOfRequest(status?.usage, status?.request);
  } else if (device && view.state === 'agent-unreachable') {
    figures = '?';
  }
  let word = shortStateWord(view, trans);
  if (full && !word && view.state === 'guaranteed') {
    word = view.label;
  }
  if (!device && view.state === 'parked') {
    // It holds no GPU: "GPU parked", "GPU freezing"; never a "GPU ·" with
    // nothing after it.
    word = trans.__('GPU %1', word);
  }
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

function capitalize(text: string): string {
  return `${text.charAt(0).toUpperCase()}${text.slice(1)}`;
}

/** "2.1 GiB used of 4.0 GiB guaranteed, 8.0 GiB limit", or the last known figures. */
export function memoryLine(
  status: IKernelStatus | null,
  verified: boolean,
  trans: ITrans = defaultTrans
): string {
  const usage = formatBytes(status?.usage);
  const request = formatBytes(status?.request);
  const limit = formatBytes(status?.limit);
  return verified
    ? trans.__('%1 used of %2 guaranteed, %3 limit', usage, request, limit)
    : trans.__(
        'last known: %1 used, %2 requested, %3 limit (not verified)',
        usage,
        request,
        limit
      );
}

/**
 * Everything the item leaves out: the device, usage, request and limit (as
 * last known while unverified), the state in full and why, and what is wrong
 * with the server's settings.
 */
export function statusDescription(
  status: IKernelStatus | null,
  view: IStateView,
  problems: readonly string[] = [],
  trans: ITrans = defaultTrans,
  nowSeconds: number = Date.now() / 1000
): IStatusDescription {
  const gpu = status?.gpu ?? null;
  const device = gpu ? gpuLabel(gpu, trans) : '';
  const memory = gpu ? memoryLine(status, view.verified, trans) : '';
  const reason = view.reason ? ` ${view.reason}` : '';
  // Without a GPU, what keeps its variables is the question.
  const kept =
    view.state === 'parked' || view.state === 'waiting-for-gpu'
      ? stateKept(status, trans)
      : null;
  const lines = [
    device,
    memory && `${capitalize(memory)}.`,
    `${capitalize(view.label)}: ${view.help}${reason}`,
    kept && trans.__('State kept: %1.', kept),
    // Its age as of this rendering, from the event's own time.
    status?.last_event &&
      trans.__(
        'Last news, %1: %2',
        formatAge(status.last_event.time, nowSeconds, trans),
        status.last_event.message
      ),
    ...problems.map(problem => trans.__('Server setting problem: %1', problem)),
    trans.__('Click for details.')
  ];
  const summary = [device, memory, view.label].filter(Boolean).join(', ');
  return {
    title: lines.filter(Boolean).join('\n'),
    ariaLabel: trans.__(
      'GPU lease: %1.%2 Press Enter for details.',
      summary,
      reason
    )
  };
}

// -- what keeps a kernel's state ----------------------------------------------

/**
 * The panel's "State kept": "frozen in host memory (2.0 GiB of GPU memory)"
 * or "checkpoint on disk", and "(freezing could not be used: …)" when the
 * agent said why it could not freeze the last time it tried. Null without a
 * lease, or from an older server.
 */
export function stateKept(
  status: IKernelStatus | null | undefined,
  trans: ITrans = defaultTrans
): string | null {
  const protection = status?.protection;
  if (!protection) {
    return null;
  }
  // The server's words; the two it has today are msgids too.
  let text =
    protection === FROZEN_IN_HOST_MEMORY
      ? trans.__('frozen in host memory')
      : protection === CHECKPOINT_ON_DISK
        ? trans.__('checkpoint on disk')
        : protection;
  const bytes = status?.lease?.frozen_bytes;
  if (protection === FROZEN_IN_HOST_MEMORY && bytes) {
    text = trans.__('%1 (%2 of GPU memory)', text, formatBytes(bytes));
  }
  const fallback = (status?.fallback ?? '').trim().replace(/[\s.]+$/, '');
  if (fallback) {
    text = trans.__('%1 (freezing could not be used: %2)', text, fallback);
  }
  return text;
}

/**
 * A lease's state in the node table: the contract's words ("running",
 * "freezing", "thawing", …), and whether it is frozen while it waits.
 */
export function leaseStateWords(
  lease: ILease,
  trans: ITrans = defaultTrans
): string {
  // The contract's words (generated, English) are msgids too.
  const word = LEASE_STATE_WORDS[lease.state];
  const text = word ? trans.__(word) : lease.state;
  if (lease.frozen && lease.state !== 'freezing' && lease.state !== 'thawing') {
    return trans.__('%1, frozen in host memory', text);
  }
  return text;
}

// -- what the server was asked for, and its settings -------------------------

/**
 * The panel's "Asked for": "request 0.5 (kernelspec), limit 1 (c.GpuFrac)".
 * The sources are the server's own names (a kernelspec, a c.GpuFrac setting,
 * RUNAI_GPU_MEMORY_LIMIT), shown as given; without them, the specs alone.
 * Null when there is nothing to say.
 */
export function askedFor(
  lease: ILease | null | undefined,
  source: IShareSource | null | undefined,
  trans: ITrans = defaultTrans
): string | null {
  const requestSpec = lease?.request_spec;
  const limitSpec = lease?.limit_spec ?? lease?.request_spec;
  if (!lease || (!requestSpec && !lease.limit_spec && !source?.request)) {
    return null;
  }
  const part = (spec: string | undefined, from: string | null | undefined) =>
    from
      ? trans.__('%1 (%2)', spec ?? '–', shareSourceWords(from, trans))
      : (spec ?? '–');
  return trans.__(
    'request %1, limit %2',
    part(requestSpec, source?.request),
    part(limitSpec, source?.limit)
  );
}

/**
 * Where a share came from, in words: the server's names for this notebook's
 * `%gpu request`, the request remembered for new notebooks in this
 * environment and the server's default; any other name (a kernelspec, a
 * platform's variable) as given.
 */
export function shareSourceWords(
  source: string,
  trans: ITrans = defaultTrans
): string {
  switch (source) {
    case '%gpu request':
      return trans.__('requested in this notebook');
    case 'your last %gpu request here':
      return trans.__('remembered request for this environment');
    case 'c.GpuFrac':
      return trans.__('default');
    default:
      return source;
  }
}

/** The panel's line above the problems with the server's c.GpuFrac settings. */
export function configProblemsHeading(
  count: number,
  trans: ITrans = defaultTrans
): string {
  return trans._n(
    "The server's GPU settings have a problem: kernels start without a GPU lease until it is fixed and the server restarted.",
    "The server's GPU settings have %1 problems: kernels start without a GPU lease until they are fixed and the server restarted.",
    count
  );
}

/** The error notification for settings problems, within MAX_NOTICE. */
export function configProblemsNotice(
  problems: readonly string[],
  max: number = MAX_NOTICE,
  trans: ITrans = defaultTrans
): string {
  const text =
    problems.length === 1
      ? trans.__('GPU setting problem: %1', problems[0])
      : trans.__(
          'GPU setting problems (%1): %2',
          problems.length,
          problems.join('; ')
        );
  return fitWords(text, max);
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
export function nameList(
  names: string[],
  max = Infinity,
  trans: ITrans = defaultTrans
): string {
  const shown = names.slice(0, Math.max(1, max));
  const more = names.length - shown.length;
  if (more > 0) {
    return trans.__('%1 and %2 more', shown.join(', '), more);
  }
  if (shown.length <= 1) {
    return shown.join('');
  }
  return trans.__(
    '%1 and %2',
    shown.slice(0, -1).join(', '),
    shown[shown.length - 1]
  );
}

/** "a, b" or "a, b and 3 more": a list that was already cut to `shown`. */
function cutList(shown: string[], total: number, trans: ITrans): string {
  const more = total - shown.length;
  return more > 0
    ? trans.__('%1 and %2 more', shown.join(', '), more)
    : shown.join(', ');
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

/**
 * What an incomplete restore did not bring back, in a few words each, most
 * important first: ["2 variables lost", "1 on disk", "1 cell cut off"];
 * ["not verified"] when the kernel said nothing.
 */
export function restoreShortfall(
  facts: IRestoreFacts,
  trans: ITrans = defaultTrans
): string[] {
  if (unreported(facts)) {
    return [trans.__('not verified')];
  }
  const parts: string[] = [];
  const lost = (facts.lost ?? []).length;
  if (lost) {
    parts.push(trans._n('%1 variable lost', '%1 variables lost', lost));
  }
  const deferred = deferredNames(facts).length;
  if (deferred) {
    parts.push(trans.__('%1 on disk', deferred));
  }
  if (facts.interrupted_cell) {
    parts.push(trans.__('1 cell cut off'));
  }
  return parts.length ? parts : [trans.__('not verified')];
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
function deferredList(
  facts: IRestoreFacts,
  max: number,
  trans: ITrans
): string {
  const names = deferredNames(facts);
  const shown = names
    .slice(0, Math.max(1, max))
    .map(name => `${name} (${formatBytes(facts.deferred?.[name])})`);
  return cutList(shown, names.length, trans);
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
  options: ISummaryOptions = {},
  trans: ITrans = defaultTrans
): string {
  const { maxNames = Infinity, cellChars = Infinity, advice = true } = options;
  const restored = facts.restored ?? [];
  const lost = facts.lost ?? [];
  const parts: string[] = [];
  if (facts.error) {
    parts.push(trans.__('no variables were restored: %1', facts.error));
  } else if (unreported(facts)) {
    parts.push(trans.__('the kernel did not report what came back'));
  } else {
    const total = restored.length + lost.length + deferredNames(facts).length;
    parts.push(
      trans._n(
        '%2 of %1 variable restored',
        '%2 of %1 variables restored',
        total,
        restored.length
      )
    );
  }
  if (deferredNames(facts).length) {
    const list = deferredList(facts, maxNames, trans);
    parts.push(
      advice
        ? trans.__(
            'kept on disk until there is room on the GPU: %1 — %gpu restore loads them',
            list
          )
        : trans.__('kept on disk until there is room on the GPU: %1', list)
    );
  }
  if (lost.length) {
    const shown = lost.slice(0, Math.max(1, maxNames)).map(name => {
      const why = options.reasons ? facts.lost_reasons?.[name] : undefined;
      return why ? trans.__('%1 (%2)', name, why) : name;
    });
    const list = cutList(shown, lost.length, trans);
    parts.push(
      advice
        ? trans._n(
            'lost: %2 — re-run the cells that create it',
            'lost: %2 — re-run the cells that create them',
            lost.length,
            list
          )
        : trans.__('lost: %1', list)
    );
  }
  if (facts.interrupted_cell) {
    const cell = cellLabel(facts.interrupted_cell, cellChars);
    parts.push(
      advice
        ? trans.__('cell %1 was cut off: re-run it', cell)
        : trans.__('cell %1 was cut off', cell)
    );
  }
  if (advice && unreported(facts)) {
    parts.push(trans.__('run %gpu in the notebook to see what it holds'));
  }
  return parts.join('; ');
}

/** What to do after a restore, or '' when nothing is to be done. */
export function restoreAdvice(
  facts: IRestoreFacts,
  trans: ITrans = defaultTrans
): string {
  const todo: string[] = [];
  if (facts.interrupted_cell) {
    todo.push(trans.__('re-run cell %1', cellLabel(facts.interrupted_cell)));
  }
  const lost = facts.lost ?? [];
  if (lost.length) {
    todo.push(
      trans._n(
        're-run the cell that creates %2',
        're-run the cells that create %2',
        lost.length,
        nameList(lost, Infinity, trans)
      )
    );
  }
  if (deferredNames(facts).length) {
    todo.push(
      trans.__(
        'run %gpu restore once there is room on the GPU to load %1',
        nameList(deferredNames(facts), Infinity, trans)
      )
    );
  }
  if (unreported(facts)) {
    todo.push(trans.__('run %gpu in the notebook to see what it holds'));
  }
  if (!todo.length) {
    return '';
  }
  return `${capitalize(todo.join(trans.__(', then ')))}.`;
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
  max: number = MAX_NOTICE,
  trans: ITrans = defaultTrans
): INotice {
  const prefix = notebookName(notebook);
  const facts = restoreFactsOf(event);
  const cause = sentence(event.reason ?? '');
  if (isVerifiedSuccess(event)) {
    const facts0 = sentence(restoreSummary(facts, { advice: false }, trans));
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
    const body = trans.__(
      'Restarted; what came back is not known: %1',
      restoreSummary(facts, {}, trans)
    );
    return {
      type: 'warning',
      message: fitWords(withPrefix(prefix, sentence(body)), max)
    };
  }
  if (!lost.length && !cell && deferredNames(facts).length) {
    // Nothing lost: some variables wait on disk until the GPU has room for them.
    const body = trans.__(
      'Restored; kept on disk for lack of GPU room: %1. Run %gpu restore once there is room',
      deferredList(facts, 2, trans)
    );
    return {
      type: 'warning',
      message: fitWords(withPrefix(prefix, sentence(body)), max)
    };
  }
  if (!lost.length && !cell) {
    // ok missing (an older server): the names came back, but nobody said so.
    const body = trans.__(
      'Restored, not verified: %1; run %gpu in the notebook to check',
      restoreSummary(facts, { advice: false }, trans)
    );
    return {
      type: 'warning',
      message: fitWords(withPrefix(prefix, sentence(body)), max)
    };
  }
  const advice =
    lost.length && cell
      ? trans.__('Re-run it and the cells that create the lost names.')
      : cell
        ? trans.__('Re-run it.')
        : trans._n(
            'Re-run the cells that create it.',
            'Re-run the cells that create them.',
            lost.length
          );
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
        trans._n(
          '%2 of %1 variable restored',
          '%2 of %1 variables restored',
          total,
          (facts.restored ?? []).length
        )
      );
    }
    if (lost.length) {
      // Names when there is room; only their number as a last resort.
      parts.push(
        maxNames > 0
          ? trans.__('lost: %1', nameList(lost, maxNames, trans))
          : trans._n('lost: %1 variable', 'lost: %1 variables', lost.length)
      );
    }
    if (cell) {
      parts.push(trans.__('cell %1 was cut off', cellLabel(cell, cellChars)));
    }
    const body = `${sentence(parts.join('; '))} ${advice}`;
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

/** One entry of a kernel's history: an event, and the steps of its story. */
export interface IHistoryEntry {
  /** The newest step: what the entry says. */
  event: IGpuFracEvent;
  /** Every step, oldest first, the newest included. */
  steps: IGpuFracEvent[];
}

/** The steps that continue a story begun by (or continued with) an event. */
const STORY_GOES_ON: Readonly<Record<string, readonly string[]>> = {
  move_pending: ['migrating', 'migrated', 'restored'],
  migrating: ['migrated', 'restored'],
  migrated: ['restored'],
  oom_killed: ['restored'],
  frozen: ['unparked']
};

/**
 * A kernel's events (oldest first) as the history shows them: one entry per
 * intervention, so that a move (its countdown, the move, the restore) reads
 * as one line that says how it ended, its steps folded beneath.
 */
export function historyEntries(events: IGpuFracEvent[]): IHistoryEntry[] {
  const entries: IHistoryEntry[] = [];
  for (const event of events) {
    const last = entries[entries.length - 1];
    if (last && STORY_GOES_ON[last.event.event]?.includes(event.event)) {
      last.steps.push(event);
      last.event = event;
    } else {
      entries.push({ event, steps: [event] });
    }
  }
  return entries;
}

/**
 * The notification of a move that waits for a running cell, as of
 * `nowSeconds`: "demo.ipynb: Moving to GPU 0 in 28 s, sooner if the running
 * cell ends: to free GPU 1 for a job." The countdown comes first, so a cut
 * only ever shortens the reason; the caller shows it again each second.
 */
export function moveNotice(
  event: IGpuFracEvent,
  notebook: string | null,
  nowSeconds: number = Date.now() / 1000,
  max: number = MAX_NOTICE,
  trans: ITrans = defaultTrans
): string {
  const to =
    event.to_gpu_index !== null && event.to_gpu_index !== undefined
      ? trans.__('GPU %1', event.to_gpu_index)
      : trans.__('another GPU');
  const left =
    event.deadline !== undefined
      ? Math.max(0, Math.ceil(event.deadline - nowSeconds))
      : null;
  const head =
    left === null
      ? trans.__('Moving to %1 once the running cell ends', to)
      : left > 0
        ? trans.__(
            'Moving to %1 in %2 s, sooner if the running cell ends',
            to,
            left
          )
        : trans.__('Moving to %1 now; the running cell is cut off', to);
  const why = (event.reason ?? '').trim().replace(/[\s.]+$/, '');
  return fitWords(
    withPrefix(notebookName(notebook), why ? `${head}: ${why}.` : `${head}.`),
    max
  );
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
 * The notification of a freeze for someone else's sake, within `max`: the
 * notebook and the server's sentence, its asides "(…)" dropped first where it
 * is too long; when the cut would lose that everything is kept, the cause is
 * cut shorter and the notice says so itself.
 */
export function frozenNotice(
  text: string,
  notebook: string | null,
  max: number = MAX_NOTICE,
  trans: ITrans = defaultTrans
): string {
  const prefix = notebookName(notebook);
  const full = withPrefix(prefix, text.replace(/\s+/g, ' ').trim());
  if (full.length <= max) {
    return full;
  }
  const bare = withPrefix(
    prefix,
    text
      .replace(/\s*\([^()]*\)/g, '')
      .replace(/\s+/g, ' ')
      .trim()
  );
  const cut = fitWords(bare, max);
  if (/host memory/i.test(cut)) {
    return cut;
  }
  const kept = trans.__(
    'Its process and every variable are kept in host memory.'
  );
  const room = Math.max(max - kept.length - 1, prefix.length + 12);
  return fitWords(`${fitWords(bare, room)} ${kept}`, max);
}

/**
 * The lease's SM utilization against its compute share, and whether the share
 * holds (only CUDA MPS holds one); null when the lease has neither.
 */
export function computeLine(
  lease: ILease,
  mps: boolean,
  trans: ITrans = defaultTrans
): string | null {
  const used = lease.compute_usage;
  const request = lease.compute_request;
  const usedText =
    used === null || used === undefined
      ? trans.__('not sampled')
      : trans.__("%1% of the GPU's SMs", used);
  if (request === null || request === undefined) {
    return used === null || used === undefined ? null : usedText;
  }
  const limit = lease.compute_limit;
  const share =
    limit === null || limit === undefined || limit === request
      ? `${request}`
      : `${request}–${limit}`;
  const held = mps
    ? trans.__('held by CUDA MPS')
    : trans.__('not enforced: no CUDA MPS');
  return trans.__('%1; share %2 of the compute (%3)', usedText, share, held);
}

/** "45 s", "3 min", "2 h 4 min": how long ago, as people read it. */
export function ageWords(
  seconds: number,
  trans: ITrans = defaultTrans
): string {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) {
    return trans.__('%1 s', s);
  }
  if (s < 3600) {
    return trans.__('%1 min', Math.floor(s / 60));
  }
  return trans.__(
    '%1 h %2 min',
    Math.floor(s / 3600),
    Math.floor((s % 3600) / 60)
  );
}

/**
 * "after cell [5], 3 min ago": what a restart restores now. The age is
 * computed from the checkpoint's time when shown (`now`, unix seconds). Null
 * before the first checkpoint, or from an older server.
 */
export function recoveryPointLine(
  point: IRecoveryPoint | null | undefined,
  now: number,
  trans: ITrans = defaultTrans
): string | null {
  if (
    !point ||
    point.durable_time === null ||
    point.durable_time === undefined
  ) {
    return null;
  }
  const age = ageWords(now - point.durable_time, trans);
  return point.durable_cell === null || point.durable_cell === undefined
    ? trans.__('%1 ago', age)
    : trans.__('after cell [%1], %2 ago', point.durable_cell, age);
}

/**
 * "big (4.0 GiB), … — over the per-kernel checkpoint budget …": the variables
 * a restart would not bring back, largest first, and why. Null when every
 * variable is protected.
 */
export function unprotectedLine(
  point: IRecoveryPoint | null | undefined,
  trans: ITrans = defaultTrans
): string | null {
  const names = Object.entries(point?.unprotected ?? {}).sort(
    ([a, x], [b, y]) => y - x || a.localeCompare(b)
  );
  if (!names.length) {
    return null;
  }
  const shown = names
    .map(([name, bytes]) => trans.__('%1 (%2)', name, formatBytes(bytes)))
    .join(', ');
  const why = (point?.unprotected_why ?? '').trim();
  return why ? trans.__('%1 — %2', shown, why) : shown;
}

/**
 * "after cell [6]: 1.2 GiB of 4.0 GiB": the checkpoint being written, which a
 * restart would restore once it is done. Null when none is, or unknown.
 */
export function writingLine(
  point: IRecoveryPoint | null | undefined,
  trans: ITrans = defaultTrans
): string | null {
  const writing = point?.writing;
  if (!writing) {
    return null;
  }
  const progress = writing.queued
    ? trans.__('queued, %1', formatBytes(writing.bytes_total))
    : trans.__(
        '%1 of %2',
        formatBytes(writing.bytes_done),
        formatBytes(writing.bytes_total)
      );
  return writing.cell === null || writing.cell === undefined
    ? progress
    : trans.__('after cell [%1]: %2', writing.cell, progress);
}
