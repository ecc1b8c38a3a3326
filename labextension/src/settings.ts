/**
 * Settings: the extension's own (schema/plugin.json) as the views use them,
 * and the words for problems with the server's (c.GpuFrac).
 */
import { MAX_NOTICE } from './notices';
import { defaultTrans, ITrans } from './trans';
import { fitWords } from './words';

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

// -- the server's settings ---------------------------------------------------

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
